"""A real model's short-reduction kernels (depthwise convs, GEMMs over few channels) on the GPU: one output a
thread against ``--vectors`` adjacent outputs a thread, each kernel checked and timed, with the model's total.

For each model: ``scripts/model_zoo.py``'s export (torch, torchvision), the planner's kernels for CUDA in
``--precision`` (as ``tvmfuse bench`` plans them), and every kernel the untuned rules give
:class:`tvmfuse._gpu_rules.ShortReduction`. Each is built under ``ShortReduction(vector=v)`` for every ``v`` of
``--vectors`` (1: the untuned default), run on random inputs with its outputs poisoned (NaN) first, checked against
the kernel under dlight's Fallback (``reference_schedule``: an output a thread, sums in order), and timed with TVM's
time evaluator. A kernel whose innermost output axis ``v`` does not divide keeps one output a thread (its row says
so). Prints the kernels and a per-model total last; writes ``$OUT/short_reduction.json``.

    python benchmarks/short_reduction_gpu.py --models mobilenet_v2,efficientnet_b0 --batch 32 --vectors 1,4,8
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


def _kernels(model: Path, precision: str) -> tuple:
    """The CUDA target (this machine's GPU) and (name, module of ``main``) of the model's kernels the untuned rules
    give ShortReduction."""
    from tvmfuse._gpu_rules import ShortReduction, default_gpu_schedule
    from tvmfuse._tvm import PrimFunc, tvm
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.target import resolve_target

    target = resolve_target("cuda")
    fused, _ = partition(import_model(load_model(model, precision=precision)), target=target, precision=precision)
    out = []
    for gv, func in fused.functions.items():
        if isinstance(func, PrimFunc):
            mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
            if default_gpu_schedule(mod, target.target)[1] == ShortReduction.source:
                out.append((gv.name_hint, mod))
    return target.target, out


def _build(sch, target):
    from tvmfuse._tvm import build_context, tvm

    with build_context():
        return tvm.compile(sch.mod, target=target)


def _lanes(sch) -> int:
    """Outputs a thread takes in a scheduled kernel: its widest vectorized loop (1: none)."""
    import re

    found = [int(n) for n in re.findall(r"T\.vectorized\((?:T\.int64\()?(\d+)", sch.mod["main"].script())]
    return max(found, default=1)


def checked(got, want, tol: float) -> dict:
    """A kernel's output against its reference (torch tensors): relative error, and ok where it is under ``tol``
    and no element was left unwritten (NaN, the poison the output was filled with)."""
    import torch

    err = float((got - want).norm() / max(float(want.norm()), 1e-30))
    return {"rel_error": err, "ok": bool(not torch.isnan(got).any() and err < tol)}


def run_kernel(name: str, mod, vectors: list, target) -> list:
    import torch

    from tvmfuse._gpu_rules import ShortReduction, reference_schedule
    from tvmfuse._tvm import param_buffers, tvm

    dev = tvm.cuda(0)
    bufs = param_buffers(mod["main"])
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtypes = {b.name: getattr(torch, str(b.dtype)) for b in bufs}
    # the last parameter is the output; inputs scaled so an fp16 sum of a few products stays well inside range
    ins = [torch.randn([int(d) for d in b.shape], device="cuda", generator=gen).to(dtypes[b.name]) * 0.5
           for b in bufs[:-1]]
    out_shape = [int(d) for d in bufs[-1].shape]

    def run(lib):
        out = torch.full(out_shape, float("nan"), device="cuda", dtype=dtypes[bufs[-1].name])
        args = [tvm.runtime.from_dlpack(t) for t in (*ins, out)]
        lib["main"](*args)
        dev.sync()
        us = float(np.median(lib.mod.time_evaluator("main", dev, number=20, repeat=5)(*args).results)) * 1e6
        return out.float(), us

    want, ref_us = run(_build(reference_schedule(mod, target, is_gpu=True), target))
    rows = []
    for v in vectors:
        row = {"kernel": name, "vector": v, "shape": out_shape, "fallback_us": ref_us}
        try:
            with target:
                sch = ShortReduction(vector=v).apply(mod["main"], target, False)
            if sch is None:
                raise RuntimeError("ShortReduction declined the kernel")
            got, us = run(_build(sch, target))
            row.update(lanes=_lanes(sch), us=us, **checked(got, want, 2e-3))
        except Exception as e:   # noqa: BLE001 - a variant that fails is a row, the rest still run
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mobilenet_v2,efficientnet_b0")
    ap.add_argument("--size", default="full", choices=("small", "full"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", default="fp16", choices=("fp32", "fp16"))
    ap.add_argument("--vectors", default="1,4,8")
    a = ap.parse_args()
    vectors = [int(v) for v in a.vectors.split(",")]
    rows, totals = [], []
    for name in [m for m in a.models.split(",") if m]:
        onnx_dir = Path(tempfile.mkdtemp(prefix="short-onnx-"))
        subprocess.run([sys.executable, str(ROOT / "scripts" / "model_zoo.py"), "export", "--out", str(onnx_dir),
                        "--models", name, "--size", a.size, "--dtypes", "float32", "--batch", str(a.batch)],
                       check=True, stdout=subprocess.DEVNULL)
        model = next(onnx_dir.glob(f"{name}*.float32.onnx"))
        mine = []
        target, kernels = _kernels(model, a.precision)
        for kernel, mod in kernels:
            mine += run_kernel(kernel, mod, vectors, target)
        rows += mine
        for v in vectors:
            timed = [r for r in mine if r["vector"] == v and "us" in r]
            totals.append({"model": name, "vector": v, "kernels": len(timed), "us": sum(r["us"] for r in timed),
                           "all_ok": all(r.get("ok") for r in mine if r["vector"] == v)})
    (Path(os.environ.get("OUT", ".")) / "short_reduction.json").write_text(json.dumps({"rows": rows,
                                                                                        "totals": totals}, indent=1))
    print(f"\n{'kernel':56} {'vector':>6} {'lanes':>5} {'ok':5} {'us':>8} {'fallback':>9}")
    for r in rows:
        print(f"{r['kernel'][:56]:56} {r['vector']:6} {r.get('lanes', '-')!s:>5} "
              f"{str(r.get('ok', r.get('error', '')))[:5]:5} {r.get('us', float('nan')):8.1f} {r['fallback_us']:9.1f}")
    print(f"\n| model | vector | kernels | total us | all ok |\n|---|---|---|---|---|")
    for t in totals:
        print(f"| {t['model']} | {t['vector']} | {t['kernels']} | {t['us']:.1f} | {t['all_ok']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
