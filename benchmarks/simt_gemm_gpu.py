"""fp32 GEMM kernels of real models on the CUDA cores: the untuned rules (dlight's Matmul, the narrow tile,
:class:`SimtMatmul` for what those decline) against every SimtMatmul tile, each kernel checked and timed beside
cuBLAS: whether SimtMatmul's tiles should take fp32 GEMMs ahead of dlight's Matmul.

For each model: ``scripts/model_zoo.py``'s export (``--size full``, ``--layers`` of its blocks, random weights),
the planner's kernels for CUDA in fp32 (as ``tvmfuse bench`` plans them), and every GEMM among them. Each is built
under the untuned rules (``default``: the rule that takes it is named) and under every tile of ``--tiles``; run on
random inputs with its output poisoned
(NaN) first, checked against the same kernel under dlight's Fallback (``reference_schedule``: an output a thread,
sums in order), and timed with TVM's time evaluator. cuBLAS: ``torch.matmul`` of the GEMM's (S, I, K) x (S, K, J)
in fp32 with TF32 off, in the same process. Prints the kernels and a per-model total last; writes
``$OUT/simt_gemm.json``.

    python benchmarks/simt_gemm_gpu.py --models vit,gpt2 --batch 8 --seq 512 --layers 1
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from short_reduction_gpu import _build, checked  # noqa: E402 - the same build and check


def _kernels(model: Path) -> tuple:
    """The CUDA target and [(name, module of ``main``, GEMM extents (S, I, J, K))] of the model's fp32 GEMMs."""
    from tvmfuse._gpu_rules import SimtMatmul, simt_matmul
    from tvmfuse._tvm import PrimFunc, tvm
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.kernels import untuned_kernel
    from tvmfuse.plan import partition
    from tvmfuse.target import resolve_target

    target = resolve_target("cuda")
    fused, _ = partition(import_model(load_model(model, precision="fp32")), target=target, precision="fp32")
    out = []
    for gv, func in fused.functions.items():
        if not isinstance(func, PrimFunc) or untuned_kernel(func, target) is not None:
            continue
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        with target.target:
            try:
                found = simt_matmul(mod["main"], target.target, SimtMatmul.TILES[-1])
            except Exception:  # noqa: BLE001 - not a GEMM this schedule takes
                continue
        if found is not None:
            out.append((gv.name_hint, mod, found[1]))
    return target, out


def _cublas_us(dims, tf32: bool = False, operands=None) -> float:
    """cuBLAS's time (us) of ``torch.matmul`` of (S, I, K) x (S, K, J) fp32 (``operands``: those two tensors), with
    TF32 off unless ``tf32``."""
    import torch

    s, i, j, k = dims
    a, b = operands or (torch.randn(s, i, k, device="cuda"), torch.randn(s, k, j, device="cuda"))
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        for _ in range(3):
            torch.matmul(a, b)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(5):
            start.record()
            for _ in range(20):
                torch.matmul(a, b)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / 20)
        return float(np.median(times))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def run_kernel(name: str, mod, dims, tiles: list, target, sms: int) -> list:
    import torch

    from tvmfuse._gpu_rules import default_gpu_schedule, reference_schedule, simt_matmul
    from tvmfuse._tvm import param_buffers, tvm

    dev = tvm.cuda(0)
    bufs = param_buffers(mod["main"])
    gen = torch.Generator(device="cuda").manual_seed(0)
    ins = [torch.randn([int(d) for d in b.shape], device="cuda", generator=gen) * 0.5 for b in bufs[:-1]]
    out_shape = [int(d) for d in bufs[-1].shape]

    def run(lib):
        out = torch.full(out_shape, float("nan"), device="cuda")
        args = [tvm.runtime.from_dlpack(t) for t in (*ins, out)]
        lib["main"](*args)
        dev.sync()
        us = float(np.median(lib.mod.time_evaluator("main", dev, number=10, repeat=5)(*args).results)) * 1e6
        return out, us

    tt = target.target
    want, _ = run(_build(reference_schedule(mod, tt, is_gpu=True), tt))
    flops = 2.0 * np.prod(dims)
    base = {"kernel": name, "dims": list(dims), "cublas_us": _cublas_us(dims)}
    variants = [("default", None)] + [(t.name(), t) for t in tiles]
    rows = []
    for label, tile in variants:
        row = dict(base, variant=label)
        try:
            if label == "default":
                sch, row["rule"] = default_gpu_schedule(mod, tt, sms)
            else:
                with tt:
                    sch = simt_matmul(mod["main"], tt, tile)[0]
            got, us = run(_build(sch, tt))
            row.update(us=us, tflops=flops / us / 1e6, **checked(got, want, 1e-4))
        except Exception as e:   # noqa: BLE001 - a variant that fails is a row, the rest still run
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    from tvmfuse._gpu_rules import SimtTile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="vit,gpt2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--tiles", default="16.16.8.8,16.16.4.4.2.2,8.16.4.4.2.2,16.16.4.4,8.16.4.4,16.4.4.4",
                    help="SimtTile fields joined by dots, comma-separated")
    a = ap.parse_args()
    tiles = [SimtTile(*map(int, t.split("."))) for t in a.tiles.split(",") if t]
    rows, totals = [], []
    for name in [m for m in a.models.split(",") if m]:
        onnx_dir = Path(tempfile.mkdtemp(prefix="simt-onnx-"))
        subprocess.run([sys.executable, str(ROOT / "scripts" / "model_zoo.py"), "export", "--out", str(onnx_dir),
                        "--models", name, "--size", "full", "--dtypes", "float32", "--batch", str(a.batch),
                        "--seq", str(a.seq), "--layers", str(a.layers)], check=True, stdout=subprocess.DEVNULL)
        model = next(onnx_dir.glob(f"{name}*.float32.onnx"))
        target, kernels = _kernels(model)
        from tvmfuse.target import device_figures

        sms = device_figures(target).sm_count
        mine = []
        for kernel, mod, dims in kernels:
            mine += run_kernel(kernel, mod, dims, tiles, target, sms)
        rows += mine
        for label in ["default"] + [t.name() for t in tiles]:
            timed = [r for r in mine if r["variant"] == label and "us" in r]
            totals.append({"model": name, "variant": label, "kernels": len(timed), "us": sum(r["us"] for r in timed),
                           "cublas_us": sum(r["cublas_us"] for r in timed),
                           "all_ok": all(r.get("ok") for r in mine if r["variant"] == label)})
    (Path(os.environ.get("OUT", ".")) / "simt_gemm.json").write_text(json.dumps({"rows": rows, "totals": totals},
                                                                                indent=1))
    print(f"\n{'kernel':44} {'dims (S,I,J,K)':22} {'variant':28} {'ok':5} {'us':>9} {'TFLOP/s':>7} {'cuBLAS':>8}")
    for r in rows:
        print(f"{r['kernel'][:44]:44} {str(r['dims']):22} {(r['variant'] + ' ' + r.get('rule', ''))[:28]:28} "
              f"{str(r.get('ok', r.get('error', '')))[:5]:5} {r.get('us', float('nan')):9.1f} "
              f"{r.get('tflops', float('nan')):7.1f} {r['cublas_us']:8.1f}")
    print("\n| model | variant | kernels | total us | cuBLAS us | all ok |\n|---|---|---|---|---|---|")
    for t in totals:
        print(f"| {t['model']} | {t['variant']} | {t['kernels']} | {t['us']:.1f} | {t['cublas_us']:.1f} | "
              f"{t['all_ok']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
