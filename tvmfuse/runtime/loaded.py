"""Load an artifact folder, checking the manifest's signature and sha256s before any library code is loaded."""
from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tvmfuse.errors import ArtifactError
from tvmfuse.machine import machine_mismatch, triple_arch

LIB_NAME, PARAMS_NAME, MANIFEST_NAME = "model.so", "params.npz", "manifest.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class LoadedArtifact:
    """A loaded model: ``run(inputs)`` returns the outputs as numpy arrays."""

    path: Path
    manifest: dict
    _vm: object
    _device: object
    _params: list
    signature: dict = field(default_factory=dict)  # tvmfuse.runtime.signing.check_manifest's answer

    @property
    def input_specs(self) -> list[dict]:
        return self.manifest["inputs"]

    @property
    def output_specs(self) -> list[dict]:
        return self.manifest["outputs"]

    def _args(self, inputs: dict[str, np.ndarray]) -> list:
        from tvm import runtime

        args = []
        for spec in self.input_specs:
            if spec["name"] not in inputs:
                raise ArtifactError(f"missing input '{spec['name']}'")
            arr = np.ascontiguousarray(inputs[spec["name"]])
            if tuple(arr.shape) != tuple(spec["shape"]) or str(arr.dtype) != spec["dtype"]:
                raise ArtifactError(f"input '{spec['name']}' is {arr.dtype}{list(arr.shape)}, "
                                    f"the artifact takes {spec['dtype']}{spec['shape']}")
            args.append(runtime.tensor(arr, self._device))
        return args + self._params

    def run(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        out = self._vm["main"](*self._args(inputs))
        return [t.numpy() for t in _flatten(out)]

    def benchmark(self, inputs: dict[str, np.ndarray], *, repeat: int = 50, warmup: int = 3,
                  min_seconds: float = 0.0) -> list[float]:
        """Latencies in seconds of at least ``repeat`` runs (each synchronised with the device), run on until
        ``min_seconds`` of wall time have passed; ``warmup`` untimed runs first."""
        args = self._args(inputs)
        fn = self._vm["main"]
        for _ in range(warmup):
            fn(*args)
        self._device.sync()
        times = []
        start = time.perf_counter()
        while len(times) < repeat or time.perf_counter() - start < min_seconds:
            t0 = time.perf_counter()
            fn(*args)
            self._device.sync()
            times.append(time.perf_counter() - t0)
        return times

    def profile(self, inputs: dict[str, np.ndarray], *, runs: int = 1, warmup: int = 3):
        """Time each kernel of ``runs`` calls of the model (after ``warmup`` untimed ones) on the host: a
        :class:`tvmfuse.runtime.profile.Profile`. See that module for what the times include."""
        from tvmfuse.runtime.profile import profile_vm

        return profile_vm(self._vm, self._device, self._args(inputs), runs=runs, warmup=warmup,
                          kernels=self.manifest.get("kernels") or [], cuda_graph=bool(self.manifest.get("cuda_graph")))


def _flatten(out) -> list:
    if hasattr(out, "numpy"):
        return [out]
    result = []
    for item in out:
        result.extend(_flatten(item))
    return result


def manifest_digest(path: str | Path) -> str:
    """``sha256:<hex>`` of an artifact's manifest file: the one value that pins the whole artifact (the manifest
    holds the sha256s of the library and the weights). ``compile`` prints it; ``run --expect-digest`` checks it."""
    return "sha256:" + _sha256(Path(path) / MANIFEST_NAME)


def check_digest(path: str | Path, expected: str) -> None:
    """Refuse an artifact whose manifest is not the one ``expected`` names (before anything of it is loaded)."""
    want = expected.strip().lower()
    want = want if want.startswith("sha256:") else "sha256:" + want
    if (Path(path) / MANIFEST_NAME).is_file() and manifest_digest(path) != want:
        raise ArtifactError(f"the manifest of {path} is not the expected one: its digest is {manifest_digest(path)}, "
                            f"not {want}")


def read_manifest(path: str | Path) -> dict:
    folder = Path(path)
    if not folder.is_dir():
        raise ArtifactError(f"artifact folder not found: {folder}")
    mpath = folder / MANIFEST_NAME
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"not a tvmfuse artifact (no {MANIFEST_NAME}): {folder}") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArtifactError(f"unreadable manifest {mpath}: {err}") from None
    for key in ("files", "inputs", "outputs", "target_kind"):
        if key not in manifest:
            raise ArtifactError(f"manifest {mpath} lacks '{key}'")
    return manifest


def _machine_of(manifest: dict) -> dict:
    """The manifest's ``machine``; for artifacts compiled before it was written, what the target tells (an llvm
    target's ``mtriple``, a CUDA target's ``arch``)."""
    if isinstance(manifest.get("machine"), dict):
        return manifest["machine"]
    target = manifest.get("target") if isinstance(manifest.get("target"), dict) else {}
    triple = target.get("mtriple") if manifest.get("target_kind") == "llvm" else None
    return {"arch": triple_arch(triple) if triple else None, "triple": triple,
            "cuda_arch": target.get("arch") if manifest.get("target_kind") == "cuda" else None}


def check_machine(manifest: dict) -> None:
    """Refuse an artifact built for another machine (another CPU architecture, or a CUDA arch this GPU cannot
    run) with one line, before its library is loaded: loading it would fail with a linker error at best."""
    why = machine_mismatch(_machine_of(manifest))
    if why:
        raise ArtifactError(why)


def load_artifact(path: str | Path, *, verify_hash: bool = True, trust_unsigned: bool = False) -> LoadedArtifact:
    """Load an artifact folder written by ``tvmfuse compile``.

    Before the library is loaded (loading a shared library runs its code): the manifest's signature must verify
    with this machine's signing key (``tvmfuse.runtime.signing``), the manifest's ``machine`` must be this one
    (its CPU architecture; a CUDA build's arch against the GPU's compute capability), and the sha256 of
    ``model.so`` and ``params.npz`` must match the manifest. ``trust_unsigned`` loads an unsigned artifact, one
    signed with another key, or one this machine has no key to check, with an :class:`UntrustedArtifactWarning`;
    a signature that does not match this machine's key (a changed manifest) is refused even then.
    """
    from tvmfuse.runtime.signing import UntrustedArtifactWarning, check_manifest

    folder = Path(path)
    manifest = read_manifest(folder)
    signature = check_manifest(manifest, trust_unsigned=trust_unsigned)
    if signature["warning"]:
        warnings.warn(signature["warning"], UntrustedArtifactWarning, stacklevel=2)
    check_machine(manifest)
    for name in (LIB_NAME, PARAMS_NAME):
        f = folder / name
        if not f.is_file():
            raise ArtifactError(f"artifact is missing {name}: {folder}")
        if f.is_symlink():
            raise ArtifactError(f"artifact file {name} is a symbolic link; refusing to load it")
        if verify_hash and _sha256(f) != manifest["files"].get(name):
            raise ArtifactError(f"sha256 of {f} does not match the manifest; refusing to load it")
    import tvm
    from tvm import relax, runtime

    device = tvm.cuda(0) if manifest["target_kind"] == "cuda" else tvm.cpu(0)
    if not device.exist:
        raise ArtifactError(f"the artifact was built for {manifest['target_kind']} ({manifest.get('device')}), "
                            "which this machine does not have")
    if manifest["target_kind"] == "cuda":   # TVM compiles the kernels' CUDA source as the library loads
        from tvmfuse.nvcc_cache import install

        install()
    lib = runtime.load_module(str(folder / LIB_NAME))
    vm = relax.VirtualMachine(lib, device)
    with np.load(folder / PARAMS_NAME, allow_pickle=False) as npz:
        params = [runtime.tensor(npz[f"param_{i}"], device) for i in range(int(manifest.get("num_params", 0)))]
    return LoadedArtifact(path=folder, manifest=manifest, _vm=vm, _device=device, _params=params,
                          signature=signature)
