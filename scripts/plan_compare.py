"""Compare fusion plans, FuseOps vs tvmfuse, on ONNX models: kernels and HBM bytes (a Markdown table).

Usage: python scripts/plan_compare.py [--target llvm] [--verify] MODEL.onnx ...
With --verify, both partitioned modules are built on llvm and their outputs compared with onnxruntime
(inputs from MODEL's sibling ``<name>.inputs.npz`` when present).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _verify(path: Path, loaded, fused_mods, target) -> str:
    import onnxruntime as ort

    from tvmfuse._tvm import relax, tvm
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    npz = path.with_name(path.name.split(".")[0] + ".inputs.npz")
    rng = np.random.default_rng(0)
    if npz.exists():
        data = np.load(npz)
        ins = [data[s.name] for s in loaded.inputs]
    else:
        ins = [rng.standard_normal(s.shape).astype(s.dtype) for s in loaded.inputs]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ref = sess.run(None, {s.name: x for s, x in zip(loaded.inputs, ins)})[0]
    errs = []
    for mod in fused_mods:
        seq = tvm.transform.Sequential(cpu.dataflow_lower_passes(target.target) + cpu.finalize_passes(target.target))
        exe = tvm.compile(mod, target.target, relax_pipeline=seq)
        out = relax.VirtualMachine(exe, tvm.cpu())["main"](*[tvm.runtime.tensor(x) for x in ins])
        out = out[0] if not hasattr(out, "numpy") else out
        errs.append(float(np.max(np.abs(out.numpy() - ref)) / max(float(np.max(np.abs(ref))), 1e-12)))
    return " / ".join(f"{e:.1e}" for e in errs)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--verify", action="store_true")
    args = ap.parse_args(argv)

    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.target import resolve_target

    target = resolve_target(args.target)
    print("| model | ops (unfused kernels) | FuseOps kernels | tvmfuse kernels | HBM unfused MiB | FuseOps MiB "
          "| tvmfuse MiB | tvmfuse patterns | plan time s | rel. err FuseOps / tvmfuse |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in args.models:
        try:
            loaded = load_model(path)
            mod = import_model(loaded)
            t0 = time.time()
            base_mod, base = partition(mod, target=target, planner="fuseops")
            t1 = time.time()
            mine_mod, mine = partition(mod, target=target, planner="tvmfuse")
            t2 = time.time()
        except Exception as e:  # noqa: BLE001 - one model failing must not hide the others
            print(f"| {path.name} | error: {type(e).__name__}: {str(e).splitlines()[0][:120]} |||||||||")
            sys.stdout.flush()
            continue
        pats: dict[str, int] = {}
        for g in mine.groups:
            if g.pattern != "single":
                pats[g.pattern] = pats.get(g.pattern, 0) + 1
        err = _verify(path, loaded, [base_mod, mine_mod], target) if args.verify else "-"
        b, m = base.totals, mine.totals
        print(f"| {path.name.split('.')[0]} | {b['kernels_unfused']} | {b['kernels_fused']} | {m['kernels_fused']} | "
              f"{_mib(b['bytes_unfused'])} | {_mib(b['bytes_fused'])} | {_mib(m['bytes_fused'])} | "
              + ", ".join(f"{k} {v}" for k, v in sorted(pats.items())) + f" | {t1 - t0:.0f} / {t2 - t1:.0f} | {err} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
