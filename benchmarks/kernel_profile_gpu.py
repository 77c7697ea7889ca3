#!/usr/bin/env python3
"""Where a model's GPU time goes, kernel by kernel: tvmfuse's build beside PyTorch's, each timed on the device.

    python benchmarks/kernel_profile_gpu.py --models resnet50 --size full --batch 32 --precision fp16 [--db DB]

For each model: ``scripts/model_zoo.py``'s export (torch, torchvision), tvmfuse's build as ``tvmfuse bench`` makes
it (the same precision conversion, partition and database; no CUDA graph, so each kernel is its own launch), and
the converted ONNX graph replayed in PyTorch eager and under torch.compile. Each runs ``--runs`` times under
``torch.profiler`` (CUPTI): every kernel's device time, whoever launched it, so the two sides are timed alike and
without the host's launch gaps. Prints, per model, tvmfuse's heaviest kernels (time a run, calls, share, schedule)
and both sides' device time by kind (GEMM/conv, the rest), each side's error against onnxruntime running the fp32
model on the CPU, then one summary table; writes ``$OUT/profile.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="kernel_profile-"))
OUT.mkdir(parents=True, exist_ok=True)

# a kernel of the GEMM / conv kind: cuBLAS, cuDNN, CUTLASS, Triton's mm templates, tvmfuse's wgmma and GEMV kernels
_MATMUL = re.compile(r"gemm|conv|cutlass|xmma|sm90_|sm80_|implicit|wgrad|dgrad|fprop|matmul|_mm_|mm_|gemv|nchw|nhwc",
                     re.IGNORECASE)


def _device_kernels(fn, runs: int) -> tuple[dict, float]:
    """{kernel name: [device µs over ``runs`` calls, launches]} of ``fn()`` under CUPTI, and the wall µs a run."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(runs):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / runs * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    kernels: dict = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in ev.name.lower() \
                and "memset" not in ev.name.lower():
            kernels[ev.name][0] += ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
            kernels[ev.name][1] += 1
    return {k: [v[0] / runs, v[1] / runs] for k, v in kernels.items()}, wall


def _split(kernels: dict) -> dict:
    mm = sum(t for name, (t, _) in kernels.items() if _MATMUL.search(name))
    total = sum(t for t, _ in kernels.values())
    return {"total_us": total, "matmul_us": mm, "other_us": total - mm,
            "launches": sum(n for _, n in kernels.values())}


def _tvmfuse(model: Path, precision: str, db: Path | None, runs: int, shapes: dict | None = None):
    import torch

    from tvmfuse import verify
    from tvmfuse._tvm import relax
    from tvmfuse.compile.build import on_device
    from tvmfuse.compile.model_check import build_checked
    from tvmfuse.db import open_database
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.target import resolve_target

    target = resolve_target("cuda")
    loaded = load_model(model, precision=precision, input_shapes=shapes or None)
    feeds_d = verify.random_inputs(loaded.inputs, seed=0)
    feeds = [feeds_d[s.name] for s in loaded.inputs]
    fused, _ = partition(import_model(loaded), target=target, precision=precision)
    database = open_database(db, target=target, create=False) if db is not None and db.exists() else None
    built, _ = build_checked(fused, target=target, database=database, cuda_graph=False)
    schedules = {k.name: k.schedule for k in built.kernels}
    dev = target.tvm_device()
    vm = relax.VirtualMachine(built.executable, dev)
    args = on_device(feeds, dev) + on_device(list(built.lifted_params), dev)
    fn = vm["main"]
    from tvmfuse.runtime.loaded import _flatten

    first = [t.numpy() for t in _flatten(fn(*args))][0]
    kernels, wall = _device_kernels(lambda: fn(*args), runs)
    torch.cuda.synchronize()
    return loaded, feeds, kernels, wall, schedules, first


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def _reference(model: Path, feeds_d: dict) -> np.ndarray:
    """The fp32 model's first output on onnxruntime (CPU): the reference both sides are checked against."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: feeds_d[i.name] for i in sess.get_inputs()})[0]


def _torch(proto, feeds: list[np.ndarray], compiled: bool, runs: int):
    import torch

    from tvmfuse.bench.torch_onnx import build_fn

    fn = build_fn(proto, "cuda")
    if compiled:
        fn = torch.compile(fn)
    args = [torch.from_numpy(a).cuda() for a in feeds]
    with torch.no_grad():
        first = fn(*args)[0].detach().float().cpu().numpy()
        return (*_device_kernels(lambda: fn(*args), runs), first)


def _schedule_of(kernel: str, schedules: dict) -> str:
    """The schedule source of a TVM device kernel (its PrimFunc's name, less ``_kernel`` and a split suffix)."""
    base = re.sub(r"_kernel(_\d+)?$", "", kernel)
    return schedules.get(base, "")


def profile_model(name: str, args) -> dict:
    from zoo_gpu import _export   # the zoo's export: model_zoo's, or scripts/user_form.py's for ``uf:NAME``

    onnx_dir = Path(tempfile.mkdtemp(prefix="profile-onnx-"))
    path, bound = _export(name, args.size, args.batch, args.seq, onnx_dir)
    model = Path(path)
    shapes = {k: tuple(int(d) for d in v.split("x")) for k, v in (b.split("=", 1) for b in bound)}
    loaded, feeds, tvm_k, tvm_wall, schedules, out = _tvmfuse(model, args.precision, args.db, args.runs, shapes)
    ref = _reference(model, {s.name: f for s, f in zip(loaded.inputs, feeds)})
    row = {"model": name, "precision": args.precision, "batch": args.batch, "seq": args.seq,
           "tvmfuse": {**_split(tvm_k), "wall_us": tvm_wall, "rel_error": _rel_err(out, ref),
                       "kernels": sorted(([k, t, n, _schedule_of(k, schedules)] for k, (t, n) in tvm_k.items()),
                                         key=lambda r: -r[1])}}
    for side, compiled in (("eager", False), ("compile", True)):
        try:
            k, wall, first = _torch(loaded.proto, feeds, compiled, args.runs)
            row[side] = {**_split(k), "wall_us": wall, "rel_error": _rel_err(first, ref),
                         "kernels": sorted(([n, t, c] for n, (t, c) in k.items()), key=lambda r: -r[1])[:40]}
        except Exception as err:   # noqa: BLE001 - a baseline that fails is reported, the rest still runs
            row[side] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
    return row


def _print_row(row: dict, top: int) -> None:
    t = row["tvmfuse"]
    print(f"\n== {row['model']} {row['precision']} batch {row['batch']}: tvmfuse kernels {t['total_us']:.1f} us a run "
          f"({t['launches']:.0f} launches; GEMM/conv {t['matmul_us']:.1f}, rest {t['other_us']:.1f}); error against "
          f"onnxruntime fp32 {t['rel_error']:.1e} (eager {row.get('eager', {}).get('rel_error', float('nan')):.1e})")
    print(f"{'kernel':64} {'us/run':>9} {'calls':>5} {'share':>6}  schedule")
    for name, us, calls, sched in t["kernels"][:top]:
        print(f"{name[:64]:64} {us:9.1f} {calls:5.0f} {100 * us / t['total_us']:5.1f}%  {sched}")
    for side in ("eager", "compile"):
        s = row.get(side, {})
        if "error" in s:
            print(f"torch {side}: {s['error']}")
            continue
        print(f"\ntorch {side}: kernels {s['total_us']:.1f} us ({s['launches']:.0f} launches; GEMM/conv "
              f"{s['matmul_us']:.1f}, rest {s['other_us']:.1f}); heaviest:")
        for name, us, calls in s["kernels"][:min(top, 12)]:
            print(f"  {name[:90]:90} {us:9.1f} {calls:4.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50")
    ap.add_argument("--size", default="full", choices=("small", "full"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence of the text models")
    ap.add_argument("--precision", default="fp16", choices=("fp32", "tf32", "fp16"))
    ap.add_argument("--db", type=Path, default=None, help="a tuning database to build from (default: untuned)")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    rows = []
    for name in [m for m in args.models.split(",") if m]:
        try:
            row = profile_model(name, args)
        except Exception as err:   # noqa: BLE001 - one model's failure is a row, the others still run
            row = {"model": name, "error": f"{type(err).__name__}: {str(err)[:300]}"}
        rows.append(row)
        (OUT / "profile.json").write_text(json.dumps(rows, indent=1))
        if "error" not in row:
            _print_row(row, args.top)
    print("\n| model | precision | batch | tvmfuse kernels us (GEMM/conv, rest) | eager | compile "
          "| tvmfuse / compile |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['model']} | – | – | {row['error']} | | | |")
            continue
        cells = []
        for side in ("tvmfuse", "eager", "compile"):
            s = row.get(side, {})
            cells.append("–" if "total_us" not in s else
                         f"{s['total_us']:.1f} ({s['matmul_us']:.1f}, {s['other_us']:.1f})")
        c = row.get("compile", {}).get("total_us")
        ratio = f"{row['tvmfuse']['total_us'] / c:.2f}" if c else "–"
        print(f"| {row['model']} | {row['precision']} | {row['batch']} | {' | '.join(cells)} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
