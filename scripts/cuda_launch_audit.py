"""Check a model's CUDA build against the launch limits, without a GPU: the kernels that the GPU would refuse.

    python scripts/cuda_launch_audit.py MODEL.onnx [MODEL.onnx ...] [--precision fp32,fp16]

For each model and precision: partition for ``cuda`` (sm_90a), build untuned, and read every kernel's launch from
its scheduled TIR (the ``blockIdx`` extents) and its CUDA source (each device function's block size, each
thread's local arrays, static shared memory). A kernel breaks a limit when it asks for more than 1024 threads a
block, a grid y or z over 65535, more than 48 KB of static shared memory, or local arrays past ``--max-local``
bytes a thread (the rotary kernel of LLaMA at 8 x 512 tokens asked for 1 MB a thread; the H200 refused the launch
with CUDA_ERROR_INVALID_VALUE). Prints one row a model and precision, then the kernels that break a limit; exits 1 if
any does.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

WIDTH = {"float": 4, "half": 2, "float2": 8, "float4": 16, "half2": 4, "uint4": 16, "uint2": 8, "uint1": 4,
         "int": 4, "int2": 8, "int4": 16, "int64_t": 8, "signed char": 1, "char": 1, "bool": 1, "double": 8,
         "nv_bfloat16": 2}
LOCAL = re.compile(r"(?<!__shared__ )alignas\(\d+\) ([\w ]+?) (\w+)\[(\d+)\];")
SHARED = re.compile(r"__shared__ alignas\(\d+\) ([\w ]+?) (\w+)\[(\d+)\];")


def _device_functions(src: str) -> dict:
    """PrimFunc name -> [(threads a block, body)] of its device functions: TVM names them ``<name>_kernel``,
    ``<name>_kernel_1``, ... (a kernel whose schedule launches twice, a split K then its sum, is two), each with
    its block size as ``__launch_bounds__``."""
    out: dict = {}
    head = r'extern "C" __global__ void (?:__launch_bounds__\((\d+)\) )?(\w+?)_kernel(?:_\d+)?\([^)]*\) \{'
    heads = list(re.finditer(head, src))
    for i, m in enumerate(heads):
        body = src[m.end():heads[i + 1].start() if i + 1 < len(heads) else len(src)]
        out.setdefault(m.group(2), []).append((int(m.group(1) or 1), body))
    return out


def audit(path: Path, precision: str, max_local: int) -> tuple[dict, list[str]]:
    from tvmfuse.compile.build import apply_records, build
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse._gpu_rules import launch_extents
    from tvmfuse._tvm import PrimFunc
    from tvmfuse.target import resolve_target

    cuda = resolve_target("cuda")
    fused, _ = partition(import_model(load_model(path, precision=precision)), target=cuda)
    scheduled, statuses = apply_records(fused, target=cuda, database=None)
    sources = {s.name: s.schedule for s in statuses}
    built = build(fused, target=cuda, database=None)

    def walk(m):
        yield m
        for i in m.imports:
            yield from walk(i)

    src = "\n".join(m.inspect_source() for m in walk(built.executable.mod) if m.kind == "cuda")
    devices = _device_functions(src)
    problems, worst_local, worst_threads = [], 0, 0
    for gv, func in scheduled.functions.items():
        if not isinstance(func, PrimFunc):
            continue
        name = gv.name_hint
        ext = launch_extents(func)
        parts = devices.get(name, [])
        threads = max((t for t, _ in parts), default=0)
        local = max((sum(WIDTH.get(t, 4) * int(n) for t, _, n in LOCAL.findall(b)) for _, b in parts), default=0)
        shared = max((sum(WIDTH.get(t, 4) * int(n) for t, _, n in SHARED.findall(b)) for _, b in parts), default=0)
        worst_local, worst_threads = max(worst_local, local), max(worst_threads, threads)
        why = []
        if threads > 1024:
            why.append(f"{threads} threads a block")
        for axis in ("y", "z"):
            if ext.get(f"blockIdx.{axis}", 1) > 65535:
                why.append(f"grid {axis} {ext[f'blockIdx.{axis}']}")
        if shared > 48 * 1024:
            why.append(f"{shared} B static shared memory")
        if local > max_local:
            why.append(f"{local} B of local arrays a thread")
        if why:
            problems.append(f"{path.name} {precision} {name} ({sources.get(name, '?')}): " + ", ".join(why))
    row = {"model": path.name, "precision": precision, "kernels": len(statuses), "max_threads": worst_threads,
           "max_local_bytes": worst_local, "problems": len(problems)}
    return row, problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--precision", default="fp32,fp16", help="comma-separated: model | fp32 | fp16")
    ap.add_argument("--max-local", type=int, default=4096, help="bytes of local arrays a thread may ask for")
    args = ap.parse_args()
    for p in args.models:
        if not p.is_file():
            print(f"error: no such model: {p}", file=sys.stderr)
            return 2
    all_problems = []
    print(f"{'model':40} {'precision':9} {'kernels':>7} {'threads':>7} {'local B':>8} {'problems':>8}", flush=True)
    for path in args.models:
        for precision in args.precision.split(","):
            try:
                row, problems = audit(path, precision, args.max_local)
            except Exception as err:  # noqa: BLE001 - one model that does not build is its row
                print(f"{path.name:40} {precision:9} build failed: {str(err).strip().splitlines()[0][:120]}")
                all_problems.append(f"{path.name} {precision}: build failed")
                continue
            print(f"{row['model']:40} {precision:9} {row['kernels']:>7} {row['max_threads']:>7} "
                  f"{row['max_local_bytes']:>8} {row['problems']:>8}", flush=True)
            all_problems += problems
    for p in all_problems:
        print("  " + p)
    return 1 if all_problems else 0


if __name__ == "__main__":
    sys.exit(main())
