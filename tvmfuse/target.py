"""Resolve ``--target`` (auto | llvm | cuda | a TVM target JSON) into a canonical target and a device identity.

The canonical JSON and the device identity key the tuning database: a record measured on one target or
device is never returned for another.
"""
from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from functools import lru_cache

from tvmfuse._tvm import Target, tvm
from tvmfuse.errors import TargetError

# The H200 (Hopper, sm_90) as checked in shared/TVM-0.27-FACTS.md; used for "cuda" when no GPU is visible
# (CUDA code can be built here with nvcc, only running it needs the GPU). Hopper builds for "sm_90a", the
# arch-specific target: its wgmma instructions (tvmfuse.tune.hopper) exist only there, and a tuned artifact
# is specific to its GPU anyway.
H200_CUDA = {
    "kind": "cuda",
    "arch": "sm_90a",
    "max_threads_per_block": 1024,
    "max_shared_memory_per_block": 49152,
    "thread_warp_size": 32,
}


@dataclass(frozen=True)
class TargetInfo:
    """A resolved target.

    Attributes
    ----------
    target : tvm.target.Target
    kind : "llvm" or "cuda"
    canonical : the target as a canonical JSON string (sorted keys): part of every database key
    device : identity of the device records are measured on ("NVIDIA H200 sm_90", "cpu:<model> x2")
    """

    target: Target
    kind: str
    canonical: str
    device: str

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    def tvm_device(self):
        return tvm.cuda(0) if self.is_gpu else tvm.cpu(0)


@lru_cache(maxsize=1)
def _cuda_device():
    try:
        dev = tvm.cuda(0)
        return dev if dev.exist else None
    except Exception:  # noqa: BLE001 - no CUDA runtime is a normal answer here
        return None


def cuda_available() -> bool:
    return _cuda_device() is not None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _host_cpu() -> dict:
    """This machine's CPU as LLVM names it (``mcpu``: znver5, skylake-avx512, neoverse-v2 ...), so that llvm builds use
    its vector ISA (AVX2, AVX-512, SVE) instead of the generic x86-64 baseline (SSE2); ``{}`` where LLVM cannot
    tell. Being part of the target, it is part of every record's key: records never cross ISAs."""
    from tvm.target import codegen

    try:
        cpu = str(codegen.llvm_get_system_cpu())
    except Exception:  # noqa: BLE001 - a TVM built without LLVM's host detection
        return {}
    return {"mcpu": cpu} if cpu and cpu != "generic" else {}


def _check_mcpu(mcpu: str, spec: dict) -> None:
    """An ``mcpu`` LLVM does not know for the target's triple is refused (TVM accepts any string and LLVM then
    compiles for a generic CPU, silently)."""
    from tvm.target import codegen

    try:
        valid = bool(codegen.llvm_is_valid_cpu(mcpu, str(spec.get("mtriple", ""))))
    except Exception:  # noqa: BLE001 - no answer (a TVM without the check): let TVM decide
        valid = True
    if not valid:
        raise TargetError(f"unknown mcpu '{mcpu}' for {spec.get('mtriple', 'this machine')}",
                          hint="LLVM CPU names such as x86-64-v3, skylake-avx512, znver4, neoverse-v2")


def _cuda_json() -> dict:
    dev = _cuda_device()
    if dev is None:
        return dict(H200_CUDA)
    major, minor = str(dev.compute_version).split(".")
    return {
        **H200_CUDA,
        "arch": f"sm_{major}{minor}" + ("a" if major == "9" else ""),
        "max_threads_per_block": int(dev.max_threads_per_block),
        "max_shared_memory_per_block": int(dev.max_shared_memory_per_block),
        "thread_warp_size": int(dev.warp_size),
    }


def _device_identity(kind: str, spec: dict) -> str:
    if kind == "cuda":
        dev = _cuda_device()
        name = str(dev.device_name) if dev is not None else "unknown-gpu"
        return f"{name} {spec.get('arch', '?')}"
    return f"cpu:{_cpu_model()} x{spec.get('num-cores', _cpu_cores())}"


def resolve_target(spec: str | dict | None = "auto") -> TargetInfo:
    """Resolve a target spec.

    Parameters
    ----------
    spec : "auto" (cuda when TVM sees a GPU, else llvm with this machine's cores), "llvm", "cuda",
        a JSON object string or dict accepted by ``tvm.target.Target``.
    """
    if spec is None or spec == "auto":
        spec = "cuda" if cuda_available() else "llvm"
    if isinstance(spec, str):
        text = spec.strip()
        if text == "llvm":
            spec = {"kind": "llvm", "num-cores": _cpu_cores(), **_host_cpu()}
        elif text == "cuda":
            spec = _cuda_json()
        elif text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as err:
                raise TargetError(f"target is not valid JSON: {err.msg} at column {err.colno}") from None
        else:
            raise TargetError(f"unknown target '{text}'", hint="use auto, llvm, cuda or a TVM target JSON object")
    if not isinstance(spec, dict) or "kind" not in spec:
        raise TargetError("a target JSON object needs a \"kind\" (llvm or cuda)")
    kind = str(spec["kind"])
    if kind not in ("llvm", "cuda"):
        raise TargetError(f"target kind '{kind}' is not supported", hint="tvmfuse targets llvm and cuda")
    if kind == "llvm" and "mcpu" in spec:
        _check_mcpu(str(spec["mcpu"]), spec)
    try:
        target = Target(spec)
    except Exception as err:  # noqa: BLE001 - TVM raises several types for a bad target
        raise TargetError(f"TVM rejected the target: {str(err).splitlines()[0]}") from None
    canonical = json.dumps({k: v for k, v in spec.items()}, sort_keys=True, separators=(",", ":"))
    return TargetInfo(target=target, kind=kind, canonical=canonical, device=_device_identity(kind, spec))
