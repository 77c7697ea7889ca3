"""Probe: one Hopper ``wgmma.mma_async`` tile from hand-written TIR, checked against numpy.

Not part of the pipeline. tvmfuse's tensor-core kernels use ``mma.sync`` (the GEMM/conv template via
MetaSchedule's tensorize, the flash template by hand), which caps them near half of what cuBLAS and SDPA
reach on an H200. ``wgmma`` is reachable from TVMScript (``T.ptx.wgmma.*``), but its operands are 64-bit
shared-memory matrix descriptors that nothing in the TVM 0.27 bundle encodes for Hopper. This script is
the first step of a Hopper template: it computes C[64, N] = A[64, 16] · B[N, 16]ᵀ with one warpgroup and one
``wgmma.mma_async.m64nNk16.f32.f16.f16``, A and B staged K-major in shared memory without swizzle (8 x 8
core matrices, 128 contiguous bytes each), for both readings of the descriptor's two byte offsets (which
one walks K and which walks M/N), and reports which one computes A·Bᵀ.

    python scripts/wgmma_probe.py               # on an H200: build, run, check, print a table
    python scripts/wgmma_probe.py --build-only  # anywhere with nvcc: build for sm_90a and run ptxas

Ran on the H200 (2026-11-30): the reading where LBO walks K computes A·Bᵀ (relative error 7.7e-8), the other
gives 1.42. tvmfuse.tune.hopper encodes its descriptors that way (and, swizzled, as the PTX ISA's canonical layouts).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

_CORE = 128  # bytes in one 8 x 8 fp16 core matrix


def probe_source(n: int, lbo: int, sbo: int) -> str:
    """TVMScript of the probe kernel: descriptor offsets ``lbo`` / ``sbo`` (bytes). The tiles are laid out with
    element (row, k) at byte (row // 8) * 256 + (k // 8) * 128 + (row % 8) * 16 + (k % 8) * 2: K-adjacent core
    matrices 128 bytes apart, M/N-adjacent ones 256 bytes apart."""
    k_stride, row_stride = _CORE, 2 * _CORE
    acc = ", ".join(f"acc[{i}]" for i in range(n // 2))

    def desc(buf: str) -> str:
        addr = f"T.Cast('uint64', T.call_extern('uint32', '__cvta_generic_to_shared', T.address_of({buf}[0])))"
        return (f"((({addr} & T.uint64(0x3FFFF)) >> T.uint64(4)) | (T.uint64({lbo >> 4}) << T.uint64(16)) "
                f"| (T.uint64({sbo >> 4}) << T.uint64(32)))")

    def stage(dst: str, src: str, rows: int) -> str:
        # each thread copies whole 8-element rows of core matrices (16 bytes) to their byte offsets / 2
        per = rows * 2 // 128 or 1
        return (f"for it in T.serial({per}):\n"
                f"    if it * 128 + tx < {rows * 2}:\n"
                f"        for e in T.serial(8):\n"
                f"            {dst}[((it * 128 + tx) // 2 // 8) * {row_stride // 2} + ((it * 128 + tx) % 2) * "
                f"{k_stride // 2} + ((it * 128 + tx) // 2 % 8) * 8 + e] = {src}[(it * 128 + tx) // 2, "
                f"((it * 128 + tx) % 2) * 8 + e]\n")

    def ind(text: str, k: int) -> str:
        return "".join(" " * k + ln + "\n" for ln in text.splitlines())

    return f"""
@T.prim_func(s_tir=True)
def main(a: T.Buffer((64, 16), "float16"), b: T.Buffer(({n}, 16), "float16"), c: T.Buffer((64, {n}), "float32")):
    T.func_attr({{"tirx.noalias": True, "tirx.is_scheduled": True}})
    for tx in T.thread_binding(128, thread="threadIdx.x"):
        sa = T.alloc_buffer((1024,), "float16", scope="shared", align=128)
        sb = T.alloc_buffer(({n * 16},), "float16", scope="shared", align=128)
        acc = T.alloc_buffer(({n // 2},), "float32", scope="local")
{ind(stage("sa", "a", 64), 8)}{ind(stage("sb", "b", n), 8)}        T.evaluate(T.ptx.fence.proxy.async_.shared__cta())
        T.tvm_storage_sync("shared")
        for i in T.unroll({n // 2}):
            acc[i] = T.float32(0)
        T.evaluate(T.ptx.wgmma.fence.sync.aligned())
        T.evaluate(T.ptx.wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16({acc}, {desc("sa")}, {desc("sb")},
                                                                          T.ptx.pred(0), 1, 1, 0, 0))
        T.evaluate(T.ptx.wgmma.commit_group.sync.aligned())
        T.evaluate(T.ptx.wgmma.wait_group.sync.aligned(0))
        for i in T.unroll({n // 2}):
            c[tx // 32 * 16 + tx % 32 // 4 + i % 4 // 2 * 8, i // 4 * 8 + tx % 4 * 2 + i % 2] = acc[i]
"""


def build(n: int, lbo: int, sbo: int):
    import tvm
    from tvm.script import tirx as T

    func = tvm.script.parse(probe_source(n, lbo, sbo), extra_vars={"T": T})
    return tvm.compile(func, target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--n", type=int, default=64)
    args = ap.parse_args()
    rows = []
    for name, lbo, sbo in (("LBO walks K", _CORE, 2 * _CORE), ("LBO walks M/N", 2 * _CORE, _CORE)):
        lib = build(args.n, lbo, sbo)
        rec = {"reading": name}
        if args.build_only:
            with tempfile.TemporaryDirectory() as d:
                cu = Path(d) / "k.cu"
                cu.write_text(lib.mod.imports[0].inspect_source())
                out = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(Path(d) / "k.cubin"),
                                      str(cu)], capture_output=True, text=True)
            rec["ptxas"] = "ok" if out.returncode == 0 else out.stderr.strip().splitlines()[-1][:120]
        else:
            import tvm

            rng = np.random.default_rng(0)
            a = rng.standard_normal((64, 16)).astype("float16")
            b = rng.standard_normal((args.n, 16)).astype("float16")
            dev = tvm.cuda(0)
            c = tvm.runtime.tensor(np.full((64, args.n), np.nan, "float32"), dev)
            lib["main"](tvm.runtime.tensor(a, dev), tvm.runtime.tensor(b, dev), c)
            got, ref = c.numpy(), a.astype("float32") @ b.astype("float32").T
            rec["unwritten"] = int(np.isnan(got).sum())
            rec["rel_error"] = float(np.linalg.norm(np.nan_to_num(got - ref)) / np.linalg.norm(ref))
        rows.append(rec)
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
