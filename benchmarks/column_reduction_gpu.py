"""Channels-last global means on the GPU: tvmfuse's column-reduction schedule beside dlight's and PyTorch's.

For each ``--shapes`` entry ``N,H,W,C`` (fp16, NHWC; EfficientNet-B0's squeeze-excitation means at batch 32 by
default) the kernel ``cast(mean(cast(x, fp32), (1, 2)), fp16)`` is built under :class:`ColumnReduction` at each
``--lanes`` x ``--threads`` (``auto``: the rule's own choice) and under the rules an untuned build ran before it
(dlight's Reduction), checked against PyTorch's fp32 mean with the output poisoned (NaN) first, and timed with
TVM's time evaluator beside ``torch.mean`` (fp16) and the copy ceiling (a device-to-device copy of the input's
bytes, read once; the copy also writes them, so the ceiling is conservative by up to 2x), in the same run.

    python benchmarks/column_reduction_gpu.py [--shapes 32,112,112,32 ...] [--lanes auto,1,2,4] [--threads 256,512]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SM90A = {"kind": "cuda", "arch": "sm_90a"}
SHAPES = ("32,112,112,32", "32,56,56,96", "32,56,56,144", "32,28,28,144", "32,28,28,240", "32,14,14,240",
          "32,14,14,480", "32,14,14,672")


def mean_kernel(n: int, h: int, w: int, c: int):
    from tvmfuse._tvm import tvm

    te, topi = tvm.te, tvm.topi
    x = te.placeholder((n, h, w, c), "float16", name="x")
    total = topi.sum(topi.cast(x, "float32"), axis=(1, 2), keepdims=True)
    y = topi.cast(topi.divide(total, float(h * w)), "float16")
    return te.create_prim_func([x, y])


def schedule(func, rules):
    from tvmfuse._tvm import build_context, dlight, tvm

    target = tvm.target.Target(SM90A)
    mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
    with target:
        mod = dlight.ApplyDefaultSchedule(*rules)(mod)
    with build_context():
        return tvm.compile(mod, target=target)


def run_shape(text: str, lanes: list, threads: list) -> list:
    import torch
    from triton.testing import do_bench

    from tvmfuse._gpu_rules import ColumnReduction, default_gpu_rules
    from tvmfuse._tvm import dlight, tvm

    n, h, w, c = (int(v) for v in text.split(","))
    func = mean_kernel(n, h, w, c)
    x = torch.randn((n, h, w, c), device="cuda", dtype=torch.float16)
    ref = x.float().mean(dim=(1, 2), keepdim=True)
    src, dst = torch.empty_like(x), torch.empty_like(x)
    copy_us = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median") * 1e3
    torch_us = do_bench(lambda: x.mean(dim=(1, 2), keepdim=True), warmup=25, rep=100, return_mode="median") * 1e3
    dev = tvm.cuda(0)
    without = tuple(r for r in default_gpu_rules() if not isinstance(r, ColumnReduction))
    variants = [("untuned rules without it", without)]
    for ln in lanes:
        for t in threads:
            rule = ColumnReduction(threads=t, lanes=None if ln == "auto" else int(ln))
            variants.append((f"column lanes={ln} threads={t}", (rule, dlight.gpu.Fallback())))
    rows = []
    for name, rules in variants:
        row = {"shape": text, "schedule": name, "copy_us": copy_us, "torch_us": torch_us}
        try:
            lib = schedule(func, rules)
            out = torch.full(ref.shape, float("nan"), device="cuda", dtype=torch.float16)
            args = [tvm.runtime.from_dlpack(t) for t in (x, out)]
            lib["main"](*args)
            dev.sync()
            err = float((out.float() - ref).norm() / ref.norm())
            ev = lib.mod.time_evaluator("main", dev, number=20, repeat=5)
            row.update(ok=bool(err < 2e-3), rel_error=err, us=float(np.median(ev(*args).results)) * 1e6)
        except Exception as e:   # noqa: BLE001 - a variant that does not build is a row, the rest still run
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--lanes", default="auto,1,2,4")
    ap.add_argument("--threads", default="256,512")
    a = ap.parse_args()
    rows = []
    for text in a.shapes:
        rows += run_shape(text, a.lanes.split(","), [int(t) for t in a.threads.split(",")])
    out = Path(os.environ.get("OUT", ".")) / "column_reduction.json"
    out.write_text(json.dumps(rows, indent=1))
    print(f"\n{'N,H,W,C':16} {'schedule':34} {'ok':5} {'us':>8} {'torch':>8} {'copy':>8} {'copy/us':>8}")
    for r in rows:
        us = r.get("us")
        print(f"{r['shape']:16} {r['schedule']:34} {str(r.get('ok', r.get('error', '')))[:5]:5} "
              f"{us if us is None else round(us, 1)!s:>8} {r['torch_us']:8.1f} {r['copy_us']:8.1f} "
              f"{'' if not us else round(r['copy_us'] / us, 2)!s:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
