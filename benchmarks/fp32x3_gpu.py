"""fp32 GEMMs on Hopper's tensor cores in three TF32 products (the wgmma template's ``float32x3``) beside the other
ways to compute them: accuracy against float64 and time, in one process.

For each ``M,N,K`` of ``--shapes`` (``C = A @ W^T``, W stored ``[N, K]`` as the planner stores an fp32 build's weights
for the tensor cores): random A and W, and

* ``x3``: the template's ``float32x3`` kernel at its untuned default config (and at each of ``--configs``);
* ``tf32``: the template's TF32 kernel at the same default (one product, operands rounded in the kernel);
* ``simt``: the untuned CUDA-core rules' schedule of the same fp32 GEMM (dlight's Matmul, or tvmfuse's SimtMatmul
  where that declines), what an fp32 build ran before;
* cuBLAS ``torch.matmul`` in fp32 with TF32 off (what torch.compile runs in an fp32 model) and with TF32 on.

Each output is poisoned (NaN) first and compared with ``float64`` torch; each kernel is timed by TVM's time
evaluator, cuBLAS by CUDA events. Prints a table last; writes ``$OUT/fp32x3.json``.

    python benchmarks/fp32x3_gpu.py --shapes 4096,2304,768 4096,768,3072 1576,768,768 4096,4096,4096
    python benchmarks/fp32x3_gpu.py --shapes 4096,768,768 --configs "g2 m1 n128 k64 s3 r8 z128 f0"
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from simt_gemm_gpu import _cublas_us  # noqa: E402 - the same cuBLAS timing

SHAPES = ("4096,2304,768", "4096,768,768", "4096,3072,768", "4096,768,3072", "1576,768,768", "1576,3072,768",
          "4096,4096,4096", "2000,1000,1000")


def _gemm_func(m: int, n: int, k: int):
    """The planner-shaped fp32 GEMM ``C[m, n] = sum_k A[m, k] * W[n, k]`` as a TIR PrimFunc."""
    from tvmfuse._tvm import tvm

    te = tvm.te
    a = te.placeholder((m, k), "float32", name="A")
    w = te.placeholder((n, k), "float32", name="W")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * w[j, r], axis=r), name="C")
    return te.create_prim_func([a, w, c]).with_attr("global_symbol", "main")


def _template_kernel(m: int, n: int, k: int, dtype: str, cfg=None):
    from tvmfuse.kernels import wgmma as hopper

    spec = hopper.GemmSpec((), m, n, k, False, False, True, dtype=dtype)
    cfg = hopper.default_config(spec) if cfg is None else hopper.parse_config(cfg)
    decls = [f"a: T.Buffer(({m}, {k}), 'float32')", f"b: T.Buffer(({n}, {k}), 'float32')",
             f"c: T.Buffer(({m}, {n}), 'float32')"]
    func = hopper.parse(hopper.gemm_source(spec, cfg, decls, "a", "b", "c[{row}, {col}] = {acc}"))
    return func.with_attr("global_symbol", "main"), cfg.name


def run_shape(m: int, n: int, k: int, configs: list, target, sms: int) -> list:
    import torch

    from tvmfuse._gpu_rules import default_gpu_schedule
    from tvmfuse._tvm import build_context, tvm

    dev = tvm.cuda(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=gen)
    w = torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5
    want = (a.double() @ w.double().T)

    def err(got) -> float:
        return float((got.double() - want).norm() / want.norm())

    def timed(mod, label, source):
        row = {"shape": [m, n, k], "variant": label, "schedule": source}
        try:
            with build_context():
                lib = tvm.compile(mod, target=target)
            out = torch.full((m, n), float("nan"), device="cuda")
            args = [tvm.runtime.from_dlpack(t) for t in (a, w, out)]
            lib["main"](*args)
            dev.sync()
            us = float(np.median(lib.mod.time_evaluator("main", dev, number=10, repeat=5)(*args).results)) * 1e6
            row.update(us=us, tflops=2.0 * m * n * k / us / 1e6, rel_error=err(out),
                       unwritten=int(torch.isnan(out).sum()))
        except Exception as e:   # noqa: BLE001 - a variant that fails is a row, the rest still run
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
        print(json.dumps(row), flush=True)
        return row

    rows = []
    for label, dtype, cfg in [("x3", "float32x3", None), ("tf32", "float32", None)] + [
            (f"x3 {c}", "float32x3", c) for c in configs]:
        try:
            func, name = _template_kernel(m, n, k, dtype, cfg)
        except Exception as e:   # noqa: BLE001 - a config that does not fit is a row
            rows.append({"shape": [m, n, k], "variant": label, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        rows.append(timed(tvm.IRModule({"main": func}), label, f"wgmma {name}"))
    mod = tvm.IRModule({"main": _gemm_func(m, n, k)})
    sch, rule = default_gpu_schedule(mod, target, sms)
    rows.append(timed(sch.mod, "simt", rule))
    torch.backends.cuda.matmul.allow_tf32 = False
    for label, tf32 in (("cublas-fp32", False), ("cublas-tf32", True)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        got = a @ w.T
        torch.backends.cuda.matmul.allow_tf32 = False
        us = _cublas_us((1, m, n, k), tf32, (a, w.T))
        row = {"shape": [m, n, k], "variant": label, "schedule": "cuBLAS", "us": us,
               "tflops": 2.0 * m * n * k / us / 1e6, "rel_error": err(got)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    from tvmfuse._tvm import tvm
    from tvmfuse.target import device_figures, resolve_target

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), help="M,N,K each")
    ap.add_argument("--configs", nargs="*", default=[], help="more wgmma configs for the x3 kernel")
    a = ap.parse_args()
    info = resolve_target("cuda")
    target, sms = info.target, device_figures(info).sm_count
    rows = []
    with target:
        for shape in a.shapes:
            m, n, k = (int(x) for x in shape.split(","))
            rows += run_shape(m, n, k, a.configs, target, sms)
    (Path(os.environ.get("OUT", ".")) / "fp32x3.json").write_text(json.dumps(rows, indent=1))
    print(f"\n| M x N x K | variant | schedule | us | TFLOP/s | rel. error vs fp64 | cuBLAS fp32 / this |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        base = next((x.get("us") for x in rows if x["shape"] == r["shape"] and x["variant"] == "cublas-fp32"), None)
        if "us" not in r:
            print(f"| {'x'.join(map(str, r['shape']))} | {r['variant']} | {r.get('schedule', '')} | "
                  f"{r.get('error', '')[:60]} | | | |")
            continue
        print(f"| {'x'.join(map(str, r['shape']))} | {r['variant']} | {r.get('schedule', '')[:36]} | {r['us']:.1f} | "
              f"{r['tflops']:.1f} | {r['rel_error']:.1e} | {base / r['us']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
