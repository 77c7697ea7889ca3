"""Which machine a build is for, and whether this one is it: CPU architectures from LLVM triples, CUDA arches from
``sm_XY`` names. Standard library only (TVM is imported lazily, for the GPU's compute capability), so that the
deploy-side loader (``tvmfuse.runtime``) and the target resolver (``tvmfuse.target``) can both use it.
"""
from __future__ import annotations

import platform
import re

# LLVM and uname spell some architectures differently; one name for each (the one Linux's uname gives)
_ARCH_ALIASES = {"arm64": "aarch64", "amd64": "x86_64", "x64": "x86_64", "i386": "x86", "i486": "x86",
                 "i586": "x86", "i686": "x86", "ppc64el": "ppc64le", "powerpc64le": "ppc64le"}


def normalize_arch(name: str) -> str:
    name = name.strip().lower()
    return _ARCH_ALIASES.get(name, name)


def host_arch() -> str:
    """This machine's CPU architecture (``x86_64``, ``aarch64`` ...)."""
    return normalize_arch(platform.machine() or "unknown")


def triple_arch(triple: str) -> str:
    """The architecture of an LLVM triple: ``aarch64-linux-gnu`` -> ``aarch64``."""
    return normalize_arch(str(triple).split("-", 1)[0])


def is_foreign_triple(triple: str | None) -> bool:
    """True when code for ``triple`` does not run on this machine's CPU (None: the host's own triple)."""
    return bool(triple) and triple_arch(triple) != host_arch()


def zig_triple(triple: str) -> str:
    """The ``arch-os-abi`` triple zig's ``-target`` takes, from an LLVM triple: the vendor field, which zig
    does not take, is dropped (``aarch64-unknown-linux-gnu`` -> ``aarch64-linux-gnu``)."""
    parts = str(triple).split("-")
    arch = triple_arch(triple)
    if len(parts) >= 4:
        rest = parts[2:]
    elif len(parts) == 3 and parts[1] in ("unknown", "pc", "none", "conda", "redhat", "suse"):
        rest = parts[2:] + (["gnu"] if parts[2] == "linux" else [])
    else:
        rest = parts[1:]
    return "-".join([arch, *rest]) if rest else f"{arch}-linux-gnu"


_SM = re.compile(r"^sm_(\d+)([a-z]?)$")


def cuda_capability(arch: str) -> tuple[int, int, str] | None:
    """(major, minor, suffix) of ``sm_90a`` (9, 0, "a"), or None when ``arch`` is not an ``sm_`` name."""
    m = _SM.match(str(arch).strip())
    if not m or len(m.group(1)) < 2:
        return None
    digits = m.group(1)
    return int(digits[:-1]), int(digits[-1]), m.group(2)


def cuda_arch_runs_on(arch: str, major: int, minor: int) -> bool:
    """Whether a cubin built for ``arch`` runs on a GPU of compute capability ``major.minor``: the same major and
    at most its minor; an arch-specific target (``sm_90a``, Hopper's wgmma) only on exactly that capability."""
    cap = cuda_capability(arch)
    if cap is None:
        return True  # not an sm_ name (a PTX-only arch, say): leave it to the driver
    a_major, a_minor, suffix = cap
    if suffix:
        return (a_major, a_minor) == (major, minor)
    return a_major == major and a_minor <= minor


def describe_machine(*, triple: str, cuda_arch: str | None = None) -> dict:
    """The manifest's ``machine``: the CPU the library's host code is for and, for a CUDA build, the GPU arch."""
    return {"arch": triple_arch(triple), "triple": triple, "cuda_arch": cuda_arch}


def machine_mismatch(machine: dict) -> str | None:
    """Why an artifact built for ``machine`` (the manifest's) cannot run here, as one sentence; None when it can.

    The CPU architecture is compared with this machine's (``platform.machine()``); a CUDA arch with the compute
    capability of GPU 0 when TVM sees one (a machine without a GPU is refused later, when the device is opened)."""
    arch = machine.get("arch")
    if arch and normalize_arch(arch) != host_arch():
        return (f"the artifact was built for {arch} ({machine.get('triple') or arch}); this machine is "
                f"{host_arch()}: run it on an {arch} machine, or compile it for this one")
    cuda_arch = machine.get("cuda_arch")
    if cuda_arch:
        found = _gpu_capability()
        if found is not None:
            (major, minor), name = found
            if not cuda_arch_runs_on(cuda_arch, major, minor):
                return (f"the artifact was built for {cuda_arch}; this GPU ({name}) has compute capability "
                        f"{major}.{minor}: compile it for sm_{major}{minor}{'a' if major == 9 else ''}")
    return None


def _gpu_capability() -> tuple[tuple[int, int], str] | None:
    try:
        import tvm

        dev = tvm.cuda(0)
        if not dev.exist:
            return None
        major, minor = (int(x) for x in str(dev.compute_version).split("."))
        return (major, minor), str(dev.device_name)
    except Exception:  # noqa: BLE001 - no CUDA runtime: nothing to compare with
        return None
