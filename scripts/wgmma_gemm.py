"""The Hopper wgmma GEMM template on the GPU: configs checked and timed beside cuBLAS (torch.matmul).

For the ANCHORS.md GEMM case (8192^3 fp16, ``relu(A @ W + bias)``, W stored [K, N]) it builds each given
config of ``tvmfuse.tune.hopper`` with that epilogue, checks it against torch on fresh random inputs
with the output poisoned (NaN) first, and times it with TVM's time evaluator; ``torch.matmul`` alone
(cuBLAS) and ``relu(A @ W + b)`` are timed in the same run. A small K-major case (W stored [N, K]) is
checked too. ``--build-only`` builds for sm_90a and runs ptxas (no GPU).

    python scripts/wgmma_gemm.py [--configs "g2 m1 n128 k64 s4 r8" ...] [--json out.json] [--build-only]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tvmfuse.tune.hopper import GemmSpec, configs, gemm_source, parse, parse_config  # noqa: E402

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def kernel(spec: GemmSpec, cfg):
    M, N, K = spec.m, spec.n, spec.k
    b_shape = (N, K) if spec.b_kmajor else (K, N)
    params = [f"a: T.Buffer(({M}, {K}), 'float16')", f"w: T.Buffer({b_shape!r}, 'float16')",
              f"bias: T.Buffer(({N},), 'float16')", f"out: T.Buffer(({M}, {N}), 'float16')"]
    store = "out[{row}, {col}] = T.max(T.Cast('float16', {acc}) + bias[{col}], T.float16(0))"
    return parse(gemm_source(spec, cfg, params, "a", "w", store))


def build(spec, cfg):
    import tvm

    return tvm.compile(kernel(spec, cfg), target=tvm.target.Target(SM90A))


def ptxas(lib) -> str:
    with tempfile.TemporaryDirectory() as d:
        cu = Path(d) / "k.cu"
        cu.write_text(lib.mod.imports[0].inspect_source())
        out = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(Path(d) / "k.cubin"),
                              str(cu)], capture_output=True, text=True)
    if out.returncode:
        return "FAIL " + out.stderr.strip().splitlines()[-1][:200]
    regs = [ln for ln in out.stderr.splitlines() if "registers" in ln]
    return regs[-1].strip() if regs else "ok"


def run_case(spec, cfg, timing: bool) -> dict:
    import torch
    import tvm

    rec = {"config": cfg.name, "b": "kmajor" if spec.b_kmajor else "nmajor", "shape": [spec.m, spec.n, spec.k]}
    t0 = time.time()
    try:
        lib = build(spec, cfg)
    except Exception as err:  # noqa: BLE001
        rec["error"] = str(err).strip().splitlines()[-1][:200]
        return rec
    rec["build_s"] = round(time.time() - t0, 2)
    dev = tvm.cuda(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    A = torch.randn(spec.m, spec.k, device="cuda", dtype=torch.float16, generator=g)
    W = torch.randn(*((spec.n, spec.k) if spec.b_kmajor else (spec.k, spec.n)), device="cuda", dtype=torch.float16,
                    generator=g) * 0.02
    bias = torch.randn(spec.n, device="cuda", dtype=torch.float16, generator=g)
    out = torch.full((spec.m, spec.n), float("nan"), device="cuda", dtype=torch.float16)
    args = [tvm.runtime.from_dlpack(t) for t in (A, W, bias, out)]
    try:
        lib["main"](*args)
        dev.sync()
    except Exception as err:  # noqa: BLE001 - e.g. more shared memory than a block may have
        rec["error"] = str(err).strip().splitlines()[-1][:200]
        return rec
    Wk = W.t() if spec.b_kmajor else W
    ref = torch.relu((A.float() @ Wk.float()) + bias.float())
    got = out.float()
    rec["unwritten"] = int(torch.isnan(got).sum())
    rec["rel_error"] = float(torch.linalg.norm(torch.nan_to_num(got - ref)) / torch.linalg.norm(ref))
    rec["ok"] = rec["unwritten"] == 0 and rec["rel_error"] < 1e-2
    if timing and rec["ok"]:
        ev = lib.mod.time_evaluator("main", dev, number=20, repeat=5)
        us = float(np.median(ev(*args).results)) * 1e6
        rec["us"] = round(us, 1)
        rec["tflops"] = round(2 * spec.m * spec.n * spec.k / us / 1e6, 1)
    return rec


def torch_us(spec) -> dict:
    import torch

    A = torch.randn(spec.m, spec.k, device="cuda", dtype=torch.float16)
    W = torch.randn(spec.k, spec.n, device="cuda", dtype=torch.float16)
    b = torch.randn(spec.n, device="cuda", dtype=torch.float16)

    def t(f):
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                f()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / 20)
        return float(np.median(times))

    return {"cublas_us": round(t(lambda: A @ W), 1), "torch_fused_us": round(t(lambda: torch.relu(A @ W + b)), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", default=None)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--json", default=None)
    ap.add_argument("--build-only", action="store_true")
    a = ap.parse_args()
    spec = GemmSpec(batch=(), m=a.size, n=a.size, k=a.size, a_batched=False, b_batched=False, b_kmajor=False)
    cfgs = [parse_config(c) for c in a.configs] if a.configs else configs(spec)
    if a.build_only:
        for c in cfgs:
            for s in (spec, GemmSpec((), 1024, 1024, 1024, False, False, True)):
                t0 = time.time()
                print(c.name, "kmajor" if s.b_kmajor else "nmajor", ptxas(build(s, c)), f"{time.time() - t0:.1f}s",
                      flush=True)
        return 0
    rows = []
    small = GemmSpec((), 1024, 1024, 1024, False, False, True)
    for c in cfgs[:3]:
        if c in configs(small):
            rows.append(run_case(small, c, timing=False))
            print(json.dumps(rows[-1]), flush=True)
    base = torch_us(spec)
    for c in cfgs:
        rows.append(run_case(spec, c, timing=True))
        print(json.dumps(rows[-1]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"torch": base, "rows": rows}, indent=1))
    print(f"\ncuBLAS A@W {base['cublas_us']} us ({2 * a.size ** 3 / base['cublas_us'] / 1e6:.0f} TFLOP/s), "
          f"torch relu(A@W+b) {base['torch_fused_us']} us")
    print(f"{'config':24} {'B':7} {'ok':5} {'rel err':>9} {'us':>9} {'TFLOP/s':>8} {'x cuBLAS':>8}")
    for r in rows:
        us = r.get("us")
        print(f"{r['config']:24} {r['b']:7} {str(r.get('ok', r.get('error', '')))[:5]:5} "
              f"{r.get('rel_error', float('nan')):9.2e} {us or '-':>9} {r.get('tflops', '-'):>8} "
              f"{(base['cublas_us'] / us) if us else float('nan'):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
