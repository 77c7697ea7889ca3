"""The ceilings a kernel is measured against: memory bandwidth and peak FLOP/s of the target's device.

GPU figures are the measured anchors of ``shared/ANCHORS.md`` (one H200: device-to-device copy 4275 GB/s,
bytes read + written; cuBLAS fp16 GEMM 656 TFLOP/s). Another GPU has no figure unless the caller gives one.
A CPU is measured once per process on this machine, with numpy: a 64 MiB ``copyto`` (bytes read +
written, best of 10, one thread) and a 1024³ fp32 matmul through numpy's BLAS (best of 3). They are only
used when the records were measured on this machine's CPU model; otherwise the ceiling is unknown.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np

H200_COPY_GBS = 4275.0
H200_FP16_GEMM_FLOPS = 656e12


@dataclass(frozen=True)
class Ceilings:
    """Bandwidth (GB/s, 1e9 bytes) and compute (FLOP/s) ceilings, each with where it came from.

    ``memory`` names what the bandwidth ceiling is of: "HBM" (a GPU's), "DRAM" (a CPU's main memory), or None
    when unknown. A CPU kernel whose data fits in its caches never goes to DRAM and can run faster than the DRAM
    ceiling, so a share of it says nothing there.
    """

    bandwidth_gbs: float | None
    bandwidth_source: str
    flops_per_s: float | None
    flops_source: str
    memory: str | None = None

    @property
    def ridge_flops_per_byte(self) -> float | None:
        """Arithmetic intensity above which a kernel is compute-bound on this device."""
        if not self.bandwidth_gbs or not self.flops_per_s:
            return None
        return self.flops_per_s / (self.bandwidth_gbs * 1e9)

    def to_json(self) -> dict:
        return {**asdict(self), "ridge_flops_per_byte": self.ridge_flops_per_byte}


@lru_cache(maxsize=1)
def measure_memcpy_gbs(*, nbytes: int = 64 << 20, repeat: int = 10) -> float:
    """This machine's memcpy bandwidth in GB/s (bytes read + written), numpy ``copyto``, best of ``repeat``."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


@lru_cache(maxsize=1)
def measure_matmul_flops(*, n: int = 1024, repeat: int = 3) -> float:
    """This machine's fp32 matmul FLOP/s through numpy's BLAS (2·n³ per product), best of ``repeat``."""
    a = np.ones((n, n), dtype=np.float32)
    b = np.ones((n, n), dtype=np.float32)
    a @ b
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


def _this_cpu_device() -> str:
    from tvmfuse.target import _cpu_model

    return f"cpu:{_cpu_model()}"


def ceilings_for(*, kind: str, device: str, bandwidth_gbs: float | None = None,
                 flops_per_s: float | None = None) -> Ceilings:
    """The ceilings for records measured on ``device`` (a database device identity) of target ``kind``.

    Parameters
    ----------
    kind : "llvm" or "cuda"
    device : the device identity the records carry ("NVIDIA H200 sm_90", "cpu:<model> x2")
    bandwidth_gbs, flops_per_s : figures to use instead (e.g. a data-sheet value for another GPU)
    """
    bw = (bandwidth_gbs, "given") if bandwidth_gbs else (None, "unknown")
    fl = (flops_per_s, "given") if flops_per_s else (None, "unknown")
    if kind == "cuda" and "H200" in device:
        if bw[0] is None:
            bw = (H200_COPY_GBS, "H200 device-to-device copy, measured (shared/ANCHORS.md)")
        if fl[0] is None:
            fl = (H200_FP16_GEMM_FLOPS, "H200 cuBLAS fp16 GEMM 8192³, measured (shared/ANCHORS.md)")
    elif kind == "llvm" and device.split(" x")[0] == _this_cpu_device():
        if bw[0] is None:
            bw = (round(measure_memcpy_gbs(), 2), "this machine's memcpy (numpy copyto 64 MiB, read+write), measured now")
        if fl[0] is None:
            fl = (measure_matmul_flops(), "this machine's numpy BLAS fp32 matmul 1024³, measured now")
    else:
        if bw[0] is None:
            bw = (None, f"unknown for {device}: pass a bandwidth figure")
        if fl[0] is None:
            fl = (None, f"unknown for {device}")
    memory = {"llvm": "DRAM"}.get(kind, "HBM" if kind == "cuda" and "H200" in device else None)
    return Ceilings(bandwidth_gbs=bw[0], bandwidth_source=bw[1], flops_per_s=fl[0], flops_source=fl[1],
                    memory=memory)
