"""Resolve ``--target`` (auto | llvm | cuda | a preset such as aarch64 | a TVM target JSON) into a canonical target
and a device identity.

The canonical JSON and the device identity key the tuning database: a record measured on one target or
device is never returned for another.
"""
from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from functools import lru_cache

from tvmfuse._tvm import Target, tvm
from tvmfuse.errors import TargetError
from tvmfuse.machine import describe_machine, is_foreign_triple

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

# Other machines by name, for cross-compiling (`compile --target aarch64`): a generic CPU of that architecture
# (no mcpu: the host's own CPU name means nothing there; give a JSON with "mcpu" for a specific core)
PRESETS = {
    "aarch64": {"kind": "llvm", "mtriple": "aarch64-linux-gnu"},
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

    @property
    def triple(self) -> str:
        """The LLVM triple of the host code (the CPU side of a CUDA build): the target's ``mtriple`` (its
        ``host``'s for CUDA), else this machine's."""
        llvm = self.target.host if self.is_gpu else self.target
        triple = str(llvm.attrs.get("mtriple", "")) if llvm is not None else ""
        return triple or _system_triple()

    @property
    def foreign(self) -> bool:
        """True when the build's host code is for another CPU architecture than this machine's (a cross build:
        it is linked with a cross toolchain, ``tvmfuse.compile.cross``, and cannot be run or measured here)."""
        return is_foreign_triple(self.triple)

    def runs_here(self) -> bool:
        """Whether code built for this target runs on this machine: the same CPU architecture and, when the
        target names one, this machine's ``mcpu`` (code for another CPU may use instructions this one lacks);
        for CUDA, a GPU here of the target's arch."""
        if self.foreign:
            return False
        if self.is_gpu:
            dev = cuda_device()
            return dev is not None and cuda_spec(dev)["arch"] == str(self.target.attrs.get("arch", ""))
        mcpu = json.loads(self.canonical).get("mcpu")
        return mcpu is None or mcpu == _host_cpu().get("mcpu")

    def machine(self) -> dict:
        """The machine a build for this target runs on, as the artifact's manifest names it."""
        return describe_machine(triple=self.triple,
                                cuda_arch=str(self.target.attrs.get("arch", "")) or None if self.is_gpu else None)


@lru_cache(maxsize=1)
def _system_triple() -> str:
    from tvm.target import codegen

    try:
        return str(codegen.llvm_get_system_triple())
    except Exception:  # noqa: BLE001 - a TVM without LLVM's host detection
        return f"{platform.machine()}-linux-gnu"


@lru_cache(maxsize=1)
def cuda_device():
    try:
        dev = tvm.cuda(0)
        return dev if dev.exist else None
    except Exception:  # noqa: BLE001 - no CUDA runtime is a normal answer here
        return None


def cuda_available() -> bool:
    return cuda_device() is not None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def target_cores(target) -> int:
    """The cores a CPU target (a TVM target) names (``num-cores``); 1 where it names none."""
    try:
        return max(1, int(target.attrs.get("num-cores", 1) or 1))
    except (TypeError, ValueError):
        return 1


def _cpu_cores() -> int:
    from tvmfuse.threads import usable_cpus

    return usable_cpus()


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


def cuda_spec(dev) -> dict:
    """The target JSON of a CUDA device (this machine's, or a remote one through an RPC session): its arch and
    limits, Hopper as ``sm_90a``."""
    major, minor = str(dev.compute_version).split(".")
    return {
        **H200_CUDA,
        "arch": f"sm_{major}{minor}" + ("a" if major == "9" else ""),
        "max_threads_per_block": int(dev.max_threads_per_block),
        "max_shared_memory_per_block": int(dev.max_shared_memory_per_block),
        "thread_warp_size": int(dev.warp_size),
    }


def _cuda_json() -> dict:
    dev = cuda_device()
    return dict(H200_CUDA) if dev is None else cuda_spec(dev)


def cuda_identity(device_name: str, spec: dict) -> str:
    """The device identity of a CUDA record: the GPU's name and the arch built for."""
    return f"{device_name} {spec.get('arch', '?')}"


def cpu_identity(model: str, cores) -> str:
    """The device identity of a CPU record: the CPU's model name and the cores the target uses."""
    return f"cpu:{model} x{cores}"


def host_cpu_description() -> dict:
    """This machine's CPU, as a tuner on another machine needs it to name records measured here (a tvmfuse RPC
    server answers it: ``tvmfuse.rpc.device``)."""
    return {"cpu_model": _cpu_model(), "cores": _cpu_cores(), "mcpu": _host_cpu().get("mcpu"),
            "triple": _system_triple()}


def _device_identity(kind: str, spec: dict) -> str:
    if kind == "cuda":
        dev = cuda_device()
        return cuda_identity(str(dev.device_name) if dev is not None else "unknown-gpu", spec)
    triple = spec.get("mtriple")
    if is_foreign_triple(triple):
        # another machine's CPU: this one's model and cores say nothing of it (tvmfuse.rpc names a remote
        # device by asking it; a cross build names it by what the target says)
        cpu = f" {spec['mcpu']}" if spec.get("mcpu") else ""
        cores = f" x{spec['num-cores']}" if spec.get("num-cores") else ""
        return f"cpu:{triple}{cpu}{cores}"
    return cpu_identity(_cpu_model(), spec.get("num-cores", _cpu_cores()))


def resolve_target(spec: str | dict | None = "auto") -> TargetInfo:
    """Resolve a target spec.

    Parameters
    ----------
    spec : "auto" (cuda when TVM sees a GPU, else llvm with this machine's cores), "llvm", "cuda",
        a preset naming another machine (``aarch64``: see ``PRESETS``), a JSON object string or dict accepted
        by ``tvm.target.Target``.
    """
    if spec is None or spec == "auto":
        spec = "cuda" if cuda_available() else "llvm"
    if isinstance(spec, str):
        text = spec.strip()
        if text == "llvm":
            spec = {"kind": "llvm", "num-cores": _cpu_cores(), **_host_cpu()}
        elif text == "cuda":
            spec = _cuda_json()
        elif text in PRESETS:
            spec = dict(PRESETS[text])
        elif text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as err:
                raise TargetError(f"target is not valid JSON: {err.msg} at column {err.colno}") from None
        else:
            raise TargetError(f"unknown target '{text}'", hint="use auto, llvm, cuda, "
                              + ", ".join(PRESETS) + " or a TVM target JSON object")
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


# ----------------------------------------------------------------------------------------- device figures
@dataclass(frozen=True)
class DeviceFigures:
    """What the templates' default rules read of a GPU: its SMs (a persistent or grid-stride kernel's blocks, the
    planner's "enough parallel work"), its L2, and its shared memory per SM and per block (opt-in).

    ``source`` says where they came from: ``device`` (the GPU here, of the target's arch), ``table:<arch>``
    (:data:`ARCH_FIGURES`: building for a GPU this machine does not have), or ``default:sm_90a`` (an arch the
    table lacks: the H200's figures, which the templates were tuned on). A target's ``l2_cache_size_bytes``
    overrides the L2 of any source."""

    sm_count: int
    l2_bytes: int
    shared_per_sm: int
    shared_per_block: int
    source: str

    def to_json(self) -> dict:
        return {"sm_count": self.sm_count, "l2_bytes": self.l2_bytes, "shared_per_sm": self.shared_per_sm,
                "shared_per_block": self.shared_per_block, "source": self.source}


# (SMs, L2 bytes, shared memory per SM, the most one block may opt into) of the SXM parts of each arch, from
# NVIDIA's architecture whitepapers and tuning guides: Hopper H100 / H200 SXM, Ampere A100, Ada (L40S / 4090's
# AD102 full die), Turing / Volta flagships. A card with fewer SMs (H100 PCIe: 114) is read from the device
# when present; building for it elsewhere names its figures in the target (l2) or this table.
ARCH_FIGURES = {
    "sm_90a": (132, 50 << 20, 228 << 10, 227 << 10),
    "sm_90": (132, 50 << 20, 228 << 10, 227 << 10),
    "sm_89": (142, 96 << 20, 100 << 10, 99 << 10),
    "sm_86": (84, 6 << 20, 100 << 10, 99 << 10),
    "sm_80": (108, 40 << 20, 164 << 10, 163 << 10),
    "sm_75": (72, 6 << 20, 64 << 10, 64 << 10),
    "sm_70": (80, 6 << 20, 96 << 10, 96 << 10),
}
_DEFAULT_ARCH = "sm_90a"


def device_figures(target) -> DeviceFigures:
    """The :class:`DeviceFigures` of a CUDA target (a TVM target or a :class:`TargetInfo`): the GPU here where
    its arch is the target's, else :data:`ARCH_FIGURES` of the target's arch, else the H200's."""
    target = getattr(target, "target", target)
    attrs = target.attrs if target is not None else {}
    arch = str(attrs.get("arch", "")) if attrs else ""
    dev = cuda_device()
    figures = None
    if dev is not None and arch and cuda_spec(dev)["arch"] == arch:
        per_sm = ARCH_FIGURES.get(arch, ARCH_FIGURES[_DEFAULT_ARCH])[2]   # the runtime does not report it
        figures = DeviceFigures(int(dev.multi_processor_count), int(dev.l2_cache_size_bytes), per_sm,
                                max(int(dev.max_shared_memory_per_block), per_sm - (1 << 10)), "device")
    elif arch in ARCH_FIGURES:
        figures = DeviceFigures(*ARCH_FIGURES[arch], f"table:{arch}")
    else:
        figures = DeviceFigures(*ARCH_FIGURES[_DEFAULT_ARCH], f"default:{_DEFAULT_ARCH}")
    l2 = attrs.get("l2_cache_size_bytes") if attrs else None
    if l2 is not None and int(l2) > 0:
        figures = DeviceFigures(figures.sm_count, int(l2), figures.shared_per_sm, figures.shared_per_block,
                                figures.source + "+target:l2")
    return figures


def vector_lanes(target, dtype_bits: int = 32) -> int:
    """The target's vector width in elements of ``dtype_bits`` (AVX-512: 16 floats, AVX2: 8), from its mcpu."""
    from tvm.target import codegen

    try:
        # on x86 from the mcpu's features: LLVM's own vector-width answer gave the host's 512 bits for haswell too
        if codegen.target_has_features("avx512f", target):
            bits = 512
        elif codegen.target_has_features("avx", target):
            bits = 256
        elif codegen.target_has_features("sse2", target):
            bits = 128
        else:
            bits = int(codegen.llvm_get_vector_width(target))
    except Exception:  # noqa: BLE001 - no answer from LLVM: 128 bits (SSE, NEON), which every such CPU has
        bits = 128
    return max(1, max(bits, 128) // dtype_bits)


def vector_registers(target) -> int:
    """The target's vector registers: 32 with AVX-512 (zmm0-31), else 16 (AVX2's ymm; the figure the CPU
    default's register blocks were first measured with, kept for every other CPU)."""
    from tvm.target import codegen

    try:
        return 32 if codegen.target_has_features("avx512f", target) else 16
    except Exception:  # noqa: BLE001 - no answer from LLVM: the smaller register file
        return 16


def has_vnni(target) -> bool:
    """Whether the llvm ``target``'s CPU has AVX-512 VNNI (Ice Lake, Sapphire Rapids, Zen 4 and 5)."""
    if target.kind.name != "llvm":
        return False
    try:
        return bool(tvm.target.codegen.target_has_features("avx512vnni", target))
    except Exception:  # noqa: BLE001 - a target LLVM cannot describe (a cross build's triple): no VNNI assumed
        return False
