"""Loaded by every Python process the tests start (conftest.py puts this folder first on PYTHONPATH): TVM imported
without PyTorch.

tvm_ffi (and tvm.relax) import torch, when it is installed, for a DLPack bridge to torch tensors: about 4 s of CPU in
each process, and the tests start hundreds (MetaSchedule starts new build workers for every batch of candidates, and
each CLI test is a process). tvmfuse never hands a torch tensor to TVM, so here an ``import torch`` made from TVM's own
modules fails as it would without torch installed; torch imported by anything else (the PyTorch baselines) loads as
usual, and once loaded it is what every later import gets.
"""
import sys


class _TorchOutOfTVM:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            frame = sys._getframe(1)
            while frame is not None:
                module = frame.f_globals.get("__name__") or ""
                if not module.startswith(("importlib", "_frozen_importlib")):
                    if module == "tvm" or module.startswith(("tvm.", "tvm_ffi")):
                        raise ImportError(f"{name} is not imported by TVM in tvmfuse's tests (tests/_site)")
                    return None   # the first frame outside the import machinery asked for it: not TVM
                frame = frame.f_back
        return None


if not any(isinstance(f, _TorchOutOfTVM) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchOutOfTVM())
