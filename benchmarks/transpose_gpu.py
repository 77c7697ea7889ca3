"""The conv case's NCHW -> NHWC input transpose on the GPU: sampled points of its space, checked and timed.

The conv3x3+BN+ReLU case (ANCHORS.md, 64 x 256 x 56 x 56 fp16) runs channels-last, so its NCHW input is
transposed first. This samples ``--points`` schedules of that kernel from the CUDA space (the tiled shared-memory
sketch and the flat ones), builds each, checks it against ``torch.permute`` on fresh random input with the
output poisoned (NaN) first, and times it with TVM's time evaluator beside PyTorch's own transpose
(``x.permute(0, 2, 3, 1).contiguous()``) and the device-to-device copy of the same bytes, in the same run.

    python benchmarks/transpose_gpu.py [--points 12] [--json out.json] [--build-only]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = (64, 256, 56, 56)


def _kernel(target):
    import onnx

    from tvmfuse.bench.cases import CASES
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.tune import extract_kernels

    model, _, _ = CASES["conv_bn_relu"](layout="NCHW")
    path = Path(tempfile.mkdtemp()) / "conv_bn_relu.onnx"
    onnx.save(model, path)
    fused, _ = partition(import_model(load_model(path)), target=target)
    return next(k for k in extract_kernels(fused, target=target) if k.name == "transpose")


def _torch_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=12)
    ap.add_argument("--json", default=None)
    ap.add_argument("--build-only", action="store_true", help="sample and build (no GPU): which sketches come up")
    a = ap.parse_args()

    from tvmfuse._tvm import build_context, tvm
    from tvmfuse.target import resolve_target
    from tvmfuse.tune.spaces import sample_schedules, select_space

    target = resolve_target("cuda")
    kernel = _kernel(target)
    choice = select_space(kernel.mod, target.target)
    mods = sample_schedules(kernel.mod, target.target, choice, n=a.points, seed=7)
    if a.build_only:
        for mod in mods:
            with build_context():
                src = tvm.compile(mod, target=target.target).mod.imports[0].inspect_source()
            print("tiled" if "_shared" in src else "flat", flush=True)
        return 0

    import torch

    x = torch.randn(*SHAPE, device="cuda", dtype=torch.float16)
    want = x.permute(0, 2, 3, 1).contiguous()
    nbytes = 2 * x.numel() * x.element_size()
    flat = torch.empty_like(x)
    base = {"torch_permute_us": _torch_us(lambda: x.permute(0, 2, 3, 1).contiguous()),
            "copy_us": _torch_us(lambda: flat.copy_(x))}
    rows = []
    for i, mod in enumerate(mods):
        rec = {"point": i}
        t0 = time.time()
        try:
            with build_context():
                lib = tvm.compile(mod, target=target.target)
        except Exception as err:  # noqa: BLE001 - report and go on
            rec["error"] = str(err).strip().splitlines()[-1][:160]
            rows.append(rec)
            continue
        src = lib.mod.imports[0].inspect_source()
        rec["sketch"] = "tiled" if "_shared" in src else "flat"
        rec["build_s"] = round(time.time() - t0, 1)
        out = torch.full(want.shape, float("nan"), device="cuda", dtype=torch.float16)
        args = [tvm.runtime.from_dlpack(t) for t in (x, out)]
        lib["main"](*args)
        torch.cuda.synchronize()
        rec["ok"] = bool(torch.equal(out, want))
        if rec["ok"]:
            ev = lib.mod.time_evaluator("main", tvm.cuda(0), number=50, repeat=5)
            rec["us"] = float(np.median(ev(*args).results)) * 1e6
            rec["pct_copy"] = 100 * base["copy_us"] / rec["us"]
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"shape": SHAPE, **base, "rows": rows}, indent=1))
    print(f"\ncopy {base['copy_us']:.1f} us ({nbytes / base['copy_us'] / 1e3:.0f} GB/s), "
          f"torch permute+contiguous {base['torch_permute_us']:.1f} us")
    print(f"{'point':>5} {'sketch':6} {'ok':5} {'us':>8} {'% copy':>7}")
    for r in sorted(rows, key=lambda r: r.get("us", 1e9)):
        us = f"{r['us']:8.1f} {r['pct_copy']:7.0f}" if "us" in r else f"{'-':>8} {'-':>7}"
        print(f"{r['point']:5d} {r.get('sketch', '?'):6} {str(r.get('ok', r.get('error', '')))[:5]:5} {us}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
