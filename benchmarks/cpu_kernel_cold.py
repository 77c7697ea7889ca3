"""One planned kernel of a model on the CPU, its default built alone: timed hot (back-to-back calls) and cold (each
call after streaming 400 MB through the caches, with TVM's pool woken first), as a model runs it when its weights
are evicted by the rest of the model's between calls.

    python benchmarks/cpu_kernel_cold.py MODEL.onnx KERNEL [KERNEL ...] [--rounds 7]

Prints, per kernel: hot and cold medians and the weight's bytes over the cold time (compare a plain read of the
same bytes after the same flush: about 18 GB/s on the 2-core Xeon of BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def packed_kernel(scheduled_mod, target):
    """(function, random arguments, module) of a scheduled CPU kernel built alone, its weight taken packed, as the
    build passes it, rather than rewritten inside each call."""
    from tvmfuse._tvm import tvm
    from tvmfuse.kernels.cpu.prefetch import tir_pipeline
    from tvmfuse.tune.check import param_specs

    built_mod = tvm.s_tir.transform.RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(scheduled_mod)
    with target.target:
        f = tvm.compile(built_mod, target=target.target, tir_pipeline=tir_pipeline(target.target))["main"]
    rng = np.random.default_rng(0)
    f_args = [tvm.runtime.tensor(rng.standard_normal(shape).astype(dtype))
              for _, shape, dtype in param_specs(built_mod["main"])]
    return f, f_args, built_mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if not args.model.is_file():
        sys.exit(f"model file not found: {args.model}")

    from tvmfuse.threads import apply_threads

    apply_threads(None)   # the pool on the physical cores, as a model runs (TVM's own default on x86 is half)
    from tvm import te

    from tvmfuse._tvm import tvm
    from tvmfuse.kernels.cpu import CpuTemplate
    from tvmfuse.plan.partition import plan_model
    from tvmfuse.target import resolve_target

    target = resolve_target("llvm")
    fused, _ = plan_model(args.model, target="llvm")
    flush = np.ones(100_000_000, np.float32)
    # a small parallel kernel: after the single-threaded flush it wakes TVM's pool, so the cold figure is memory
    a = te.placeholder((1 << 16,), "float32", name="A")
    b = te.compute((1 << 16,), lambda i: a[i] * 2.0, name="B")
    sch = tvm.s_tir.Schedule(te.create_prim_func([a, b]))
    outer, _ = sch.split(sch.get_loops(sch.get_sblock("B"))[0], [2, None])
    sch.parallel(outer)
    with target.target:
        wake = tvm.compile(sch.mod, target=target.target)["main"]
    wake_args = [tvm.runtime.tensor(np.ones(1 << 16, np.float32)) for _ in range(2)]

    def sample(f, f_args, cold: bool, calls: int = 5) -> float:
        times = []
        f(*f_args)
        for _ in range(calls):
            if cold:
                flush.sum()
                wake(*wake_args)
            t0 = time.perf_counter()
            f(*f_args)
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3

    found = {gv.name_hint: f for gv, f in fused.functions.items() if gv.name_hint in args.kernels}
    for name in args.kernels:
        if name not in found:
            sys.exit(f"no kernel '{name}' in the plan (names: `tvmfuse plan {args.model}`)")
        mod = tvm.IRModule({"main": found[name].with_attr("global_symbol", "main")})
        scheduled = CpuTemplate().traced_kernel(mod, target.target)
        if scheduled is None:
            print(f"{name}: no CPU default")
            continue
        f, f_args, built_mod = packed_kernel(scheduled.mod, target)
        hot, cold = [], []
        for _ in range(args.rounds):
            hot.append(sample(f, f_args, False))
            cold.append(sample(f, f_args, True))
        # the weight: the planner's layout-free buffer (the packed one), where the kernel has one
        free = [int(i) for i in (built_mod["main"].attrs or {}).get("layout_free_buffers", [])]
        weight = sum(f_args[i].numpy().nbytes for i in free)
        h, c = float(np.median(hot)), float(np.median(cold))
        rate = f", {weight / c / 1e6:.1f} GB/s cold" if weight else ""
        print(f"{name:30s} hot {h:.3f} ms  cold {c:.3f} ms  weight {weight / 1e6:.2f} MB{rate}")


if __name__ == "__main__":
    main()
