"""One planned GEMM or conv kernel of a model on the CPU, hot, under register blocks of your choice beside the CPU
default's: each built with its packed weight and timed in interleaved rounds of back-to-back calls.

    python benchmarks/cpu_tiles.py MODEL.onnx KERNEL[,KERNEL...] "default;3:32,2:7;3:16,2:14,pf" [--rounds 15]

A variant is ``default`` (the rules' choice: ``tvmfuse/kernels/cpu/schedule.py``) or ``AXIS:TILE,...`` over the
kernel's spatial axes (``3:32,2:7``: 32 output channels by 7 pixels of an NHWC conv), with ``wf`` / ``pf`` for the
weight-first or pixel-first order; a tile that does not divide its axis leaves a guarded last tile. Prints each
variant's median and least microseconds a call (kernel names: ``tvmfuse plan MODEL --target llvm``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _variant(text: str) -> tuple[dict | None, bool | None]:
    """(tiles, weight_first) of a variant; (None, None): the default."""
    if text == "default":
        return None, None
    tiles, weight_first = {}, None
    for part in text.split(","):
        if part in ("wf", "pf"):
            weight_first = part == "wf"
        else:
            axis, tile = part.split(":")
            tiles[int(axis)] = int(tile)
    return tiles, weight_first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("kernels")
    ap.add_argument("variants")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    if not args.model.is_file():
        sys.exit(f"model file not found: {args.model}")

    from tvmfuse.threads import apply_threads

    apply_threads(None)
    from tvmfuse._tvm import tvm
    from tvmfuse.kernels.cpu import CpuTemplate
    from tvmfuse.kernels.cpu import schedule as rules
    from benchmarks.cpu_kernel_cold import packed_kernel
    from tvmfuse.kernels.sketch import REDUCE, inline_all_but_outputs, iter_types
    from tvmfuse.plan.partition import plan_model
    from tvmfuse.target import resolve_target, vector_lanes, vector_registers

    target = resolve_target("llvm")
    fused, _ = plan_model(args.model, target="llvm")
    funcs = {gv.name_hint: f for gv, f in fused.functions.items()}

    def build(name: str, variant: str):
        mod = tvm.IRModule({"main": funcs[name].with_attr("global_symbol", "main")})
        tiles, weight_first = _variant(variant)
        if tiles is None:
            sch = CpuTemplate().traced_kernel(mod, target.target)
            if sch is None:
                sys.exit(f"{name}: no CPU default")
        else:
            sch = tvm.s_tir.Schedule(mod)
            inline_all_but_outputs(sch)
            found = [b for b in sch.get_child_blocks(sch.get_sblock("root")) if REDUCE in iter_types(sch, b)]
            if len(found) != 1 or not rules.is_contraction(sch, found[0]):
                sys.exit(f"{name}: not one GEMM or conv")
            rules.schedule_contraction(sch, found[0], vector_lanes(target.target), tiles=tiles,
                                       weight_first=weight_first, registers=vector_registers(target.target))
            rules.pack_weights(sch)
        f, f_args, _ = packed_kernel(sch.mod, target)
        return f, f_args

    variants = args.variants.split(";")
    for name in args.kernels.split(","):
        if name not in funcs:
            sys.exit(f"no kernel '{name}' in the plan (names: `tvmfuse plan {args.model} --target llvm`)")
        built = [build(name, v) for v in variants]
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v, (f, f_args) in zip(variants, built):
                f(*f_args)
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    f(*f_args)
                times[v].append((time.perf_counter() - t0) / args.calls * 1e6)
        print(name)
        for v in variants:
            print(f"  {v:28s} {np.median(times[v]):8.1f} us  (least {np.min(times[v]):.1f})")


if __name__ == "__main__":
    main()
