"""The GEMV template (tvmfuse/kernels/gemv/) on the GPU: decode GEMMs x[M, K] @ W[K, N] (fp16, fp32 accumulate),
with and without a fused bias + SiLU epilogue, each config of the template's space beside cuBLAS (``x @ w`` in
torch) and the device-copy ceiling of the weight's bytes; every kernel timed is checked against torch fp32. The
"default" is what an untuned sm_90a build runs: from 17 rows, the wgmma template's K split where it takes the shape
(``wgmma.config.skinny_config``), the GEMV template's default beside it.

    python benchmarks/gemv_gpu.py                 # the H200 run: a sample of each shape's configs (see --configs)
    python benchmarks/gemv_gpu.py --configs all   # every config of the space (takes far longer than 4 minutes)
    python benchmarks/gemv_gpu.py --dry-run       # here, without a GPU: build the CUDA kernels it would run

The table's "% copy" is (weight bytes / copy bandwidth) / time: 100% is the weight streamed at the rate a
device-to-device copy reaches (its read + write bytes over its time). A 4096 x 4096 fp16 weight (32 MB) fits the
H200's 50 MB L2, so repeated calls (ours and cuBLAS's alike) may read part of it from L2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(1, 4096, 11008), (16, 4096, 11008), (1, 4096, 4096), (8, 11008, 4096), (32, 4096, 11008), (64, 4096, 4096)]
SMALL = [(3, 256, 700), (1, 200, 96)]
EPILOGUES = ("none", "bias_silu")


def _store(epilogue: str) -> str:
    if epilogue == "none":
        return "p2[{row}, {col}] = T.Cast('float16', {acc})"
    # SiLU of (the sum + the bias) in fp32, one fp16 store
    h = "({acc} + T.Cast('float32', p3[{col}]))"
    return f"p2[{{row}}, {{col}}] = T.Cast('float16', {h} / (T.float32(1) + T.exp(T.float32(0) - {h})))"


def _kernel_source(m: int, k: int, n: int, epilogue: str, cfg_name: str) -> str:
    """The GEMV template's kernel of ``cfg_name``, or the wgmma template's where the name is one of its configs
    (``g1 m1 n128 k64 s4 r1 z128 f1 e1 d3``: a tiled tensor-core GEMM with a K split, beside the GEMV kernels)."""
    from tvmfuse.kernels.gemv import gemv_source, parse_config
    from tvmfuse.kernels.wgmma.spec import GemmSpec

    spec = GemmSpec((), m, n, k, False, False, False)
    params = [f"p0: T.Buffer(({m}, {k}), 'float16')", f"p1: T.Buffer(({k}, {n}), 'float16')",
              f"p2: T.Buffer(({m}, {n}), 'float16')"]
    if epilogue != "none":
        params.append(f"p3: T.Buffer(({n},), 'float16')")
    if cfg_name.startswith("g"):
        from tvmfuse.kernels import wgmma

        return wgmma.gemm_source(spec, wgmma.parse_config(cfg_name), params, "p0", "p1", _store(epilogue))
    return gemv_source(spec, parse_config(cfg_name), params, "p0", "p1", _store(epilogue), "float16")


def _ptxas_check(exe, path: str) -> str | None:
    """nvcc's ptxas on the kernel's CUDA source (sm_90a): None, or why not (a spill, an error)."""
    import subprocess

    srcs, mods, seen = [], [exe.mod], set()
    while mods:
        mod = mods.pop()
        if id(mod) not in seen:
            seen.add(id(mod))
            srcs += [mod.inspect_source()] if mod.kind == "cuda" else []
            mods.extend(mod.imports)
    cu = Path(path).with_suffix(".cu")
    cu.write_text("\n".join(srcs))
    out = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-o", str(cu.with_suffix(".cubin")),
                          str(cu)], capture_output=True, text=True, timeout=600)
    if out.returncode:
        return "nvcc: " + out.stderr.strip().splitlines()[-1][:200]
    usage = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
    if not usage or any(int(v) for u in usage for v in u):
        return "ptxas spills: " + " ".join(ln.strip() for ln in out.stderr.splitlines() if "spill" in ln)[:200]
    return None


def _build(job, ptxas: bool = False) -> tuple[str, str | None]:
    """Build one kernel to a shared library (a worker process); (path, error). ``ptxas``: also nvcc's ptxas on its
    source, a spill an error."""
    m, k, n, epilogue, cfg_name, path = job
    try:
        from tvmfuse._tvm import tvm
        from tvmfuse.kernels.wgmma.ptx import parse
        from tvmfuse.target import resolve_target

        func = parse(_kernel_source(m, k, n, epilogue, cfg_name)).with_attr("global_symbol", "gemv")
        exe = tvm.compile(tvm.IRModule({"main": func}), target=resolve_target("cuda").target)
        exe.export_library(path)
        return path, _ptxas_check(exe, path) if ptxas else None
    except Exception as err:  # noqa: BLE001 - reported in the results, the rest of the sweep goes on
        return path, f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:200] if str(err).strip() else ''}"


def _configs(m, k, n, how: str, kernels=(0, 1), also=()):
    from tvmfuse.kernels.gemv import MAX_ROWS, default_config, parse_config
    from tvmfuse.kernels.wgmma.config import skinny_config
    from tvmfuse.kernels.gemv.config import fits_shape
    from tvmfuse.kernels.gemv.kernel import space_configs
    from tvmfuse.kernels.wgmma.spec import GemmSpec
    from tvmfuse.tune.spaces import load_spaces

    spec = GemmSpec((), m, n, k, False, False, False)
    default = default_config(spec, "float16")
    space = space_configs(spec, "float16", load_spaces("cuda").for_class("gemm"))
    # each kernel's own best by the rule (CUDA cores, tensor cores), then the sample: half of it from each
    firsts = list(dict.fromkeys([default] + [c for c in (default_config(spec, "float16", mma=(p,)) for p in (0, 1))
                                             if c is not None and c in space]))
    skinny = skinny_config(spec) if m > MAX_ROWS else None
    if skinny is not None:   # what an untuned sm_90a build runs at 17-64 rows: wgmma's K split, the GEMV's beside it
        default, firsts = skinny, [skinny] + firsts
    rest = [c for c in space if c not in firsts]
    if how != "all":   # an even stride through each kernel's configs in the space's order (every knob's values)
        count, rest = int(how), []
        for i, p in enumerate(kernels):
            pool = [c for c in space if c.mma == p and c not in firsts]
            share = count // len(kernels) if i == 0 else count - count // len(kernels) * i
            rest += [pool[int(i * len(pool) / share)] for i in range(min(share, len(pool)))]
    rows = str(min(m, 64))
    extra = [c for c in (parse_config(a.replace("{M}", rows)) for a in also if not a.startswith("g"))
             if c.rows == min(m, 64) and fits_shape(spec, c, "float16")]
    wg = [c for c in _wgmma_also(spec, also) if c not in firsts]
    return default, list(dict.fromkeys(firsts + extra + rest)) + wg, len(space)


def _wgmma_also(spec, also) -> list:
    """The wgmma configs among ``also`` that fit ``spec`` (a K split where its tiles leave SMs idle)."""
    from tvmfuse.kernels import wgmma
    from tvmfuse.kernels.wgmma.config import configs

    names = [a for a in also if a.startswith("g")]
    fits = set(configs(spec, stages=(3, 4, 5), raster=(1, 8), staged=(0, 1), split=(1, 2, 3, 4, 6, 8))
               if names else ())
    return [c for c in (wgmma.parse_config(a) for a in names) if c in fits]


def _time_tvm(lib, args, dev) -> float:
    """Median seconds of the kernel: ``number`` calls a sample so a sample takes >= 30 ms, 10 samples."""
    once = lib.time_evaluator("gemv", dev, number=20, repeat=1)(*args).mean
    number = max(1, math.ceil(0.03 / max(once, 1e-7)))
    return float(lib.time_evaluator("gemv", dev, number=number, repeat=10)(*args).median)


def _time_torch(fn) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    number = max(1, math.ceil(0.03 / max((time.perf_counter() - t0) / 20, 1e-7)))
    samples = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(number):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / number)
    return sorted(samples)[len(samples) // 2]


def _copy_bandwidth() -> float:
    """Bytes a second of a device-to-device copy (read + write) of 1 GiB."""
    import torch

    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    t = _time_torch(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / t


def run(args) -> dict:
    import numpy as np
    import torch

    from tvmfuse._tvm import tvm

    dev = tvm.cuda(0)
    bw = _copy_bandwidth()
    shapes = _shapes(args)
    plan = []   # (shape, epilogue, default name, [config names], space size)
    for m, k, n in shapes:
        default, cfgs, size = _configs(m, k, n, args.configs, args.kernels, args.also)
        for epi in args.epilogues:
            # with the epilogue: the default and the other kernel's best by the rule (cfgs' first two)
            names = [c.name for c in cfgs] if epi == "none" or args.sweep_epilogue else [c.name for c in cfgs[:2]]
            plan.append(((m, k, n), epi, default.name, names, size))
    tmp = Path(tempfile.mkdtemp(prefix="gemv_gpu_"))
    jobs = [(*shape, epi, name, str(tmp / f"{'_'.join(map(str, shape))}_{epi}_{name.replace(' ', '_')}.so"))
            for shape, epi, _, names, _ in plan for name in names]
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=min(16, os.cpu_count() or 4), mp_context=get_context("spawn")) as pool:
        built = dict(zip([j[:5] for j in jobs], pool.map(_build, jobs)))
    print(f"built {len(jobs)} kernels in {time.time() - t0:.0f} s", flush=True)
    results, rows = [], []
    for (m, k, n), epi, default_name, names, size in plan:
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        w = (torch.randn(k, n, device="cuda", dtype=torch.float16, generator=gen) / math.sqrt(k)).contiguous()
        bias = torch.randn(n, device="cuda", dtype=torch.float16, generator=gen)
        ref = x.float() @ w.float()
        if epi != "none":
            ref = torch.nn.functional.silu(ref + bias.float())
        torch_fn = (lambda: x @ w) if epi == "none" else (lambda: torch.nn.functional.silu(x @ w + bias))
        t_torch = _time_torch(torch_fn)
        t_cublas = t_torch if epi == "none" else _time_torch(lambda: x @ w)
        ceiling = k * n * 2 / bw
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        targs = [tvm.runtime.from_dlpack(t) for t in ([x, w, out] + ([bias] if epi != "none" else []))]
        if epi != "none" and not args.sweep_epilogue and results and results[-1]["best"]:
            # the epilogue's rows: the default and the fastest config without it
            names = list(dict.fromkeys(names + [results[-1]["best"]["config"]]))
        timed = []
        for name in names:
            if (m, k, n, epi, name) not in built:
                built[(m, k, n, epi, name)] = _build((m, k, n, epi, name, str(tmp / f"late_{len(built)}.so")))
            path, err = built[(m, k, n, epi, name)]
            entry = {"config": name, "default": name == default_name}
            if err is None:
                lib = tvm.runtime.load_module(path)
                f = lib["gemv"]
                out.fill_(float("nan"))
                f(*targs)
                torch.cuda.synchronize()
                rel = float(torch.linalg.norm(out.float() - ref) / torch.linalg.norm(ref))
                entry.update(rel_err=rel, ok=bool(np.isfinite(rel) and rel <= 1e-2))
                if entry["ok"]:
                    entry["us"] = _time_tvm(lib, targs, dev) * 1e6
                    entry["pct_copy"] = 100 * ceiling / (entry["us"] * 1e-6)
            else:
                entry.update(ok=False, error=err)
            timed.append(entry)
        good = [e for e in timed if e.get("ok")]
        best = min(good, key=lambda e: e["us"], default=None)
        dflt = next((e for e in timed if e["default"]), None)
        res = {"shape": [m, k, n], "epilogue": epi, "space_size": size, "configs_timed": len(timed),
               "failed": [e for e in timed if not e.get("ok")], "torch_us": t_torch * 1e6,
               "cublas_us": t_cublas * 1e6, "cublas_pct_copy": 100 * ceiling / t_cublas,
               "ceiling_us": ceiling * 1e6, "default": dflt, "best": best, "all": timed}
        results.append(res)
        rows.append(res)
        print(f"{m}x{k}x{n} {epi}: default {dflt.get('us', float('nan')):.1f} us, best "
              f"{best['us'] if best else float('nan'):.1f} us ({best['config'] if best else '-'}), torch "
              f"{t_torch * 1e6:.1f} us, {len(res['failed'])} failed", flush=True)
        if args.top:
            for e in sorted(good, key=lambda e: e["us"])[:args.top]:
                print(f"    {e['us']:7.1f} us {e['pct_copy']:5.1f}%  {e['config']}", flush=True)
    doc = {"copy_bandwidth_GBps": bw / 1e9, "device": torch.cuda.get_device_name(), "results": results}
    print("\nshape              epilogue   cuBLAS us %copy | default us %copy | best us %copy  config"
          "                  | torch(+epi) us  timed/space  failed")
    for r in rows:
        d, b = r["default"] or {}, r["best"] or {}
        m, k, n = r["shape"]
        print(f"{m:>3}x{k:>5}x{n:>5}   {r['epilogue']:<9} {r['cublas_us']:8.1f} {r['cublas_pct_copy']:5.1f} | "
              f"{d.get('us', float('nan')):8.1f} {d.get('pct_copy', float('nan')):5.1f} | "
              f"{b.get('us', float('nan')):7.1f} {b.get('pct_copy', float('nan')):5.1f}  {b.get('config', '-'):<23} | "
              f"{r['torch_us']:8.1f}  {r['configs_timed']:>5}/{r['space_size']:<5} {len(r['failed'])}")
    print(f"copy ceiling {bw / 1e9:.0f} GB/s ({doc['device']})")
    return doc


def _shapes(args) -> list[tuple[int, int, int]]:
    if args.shapes:
        return [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    return SMALL if args.small else SHAPES


def dry_run(args) -> None:
    """Build (CUDA, no GPU needed) the kernels the run would time: each shape's sample without the epilogue, its
    default and each kernel's (CUDA cores, tensor cores) best by the rule with the bias + SiLU epilogue; each also
    through nvcc's ptxas for sm_90a, a register spill a failure."""
    shapes = _shapes(args)
    jobs = []
    tmp = Path(tempfile.mkdtemp(prefix="gemv_dry_"))
    for m, k, n in shapes:
        default, cfgs, size = _configs(m, k, n, args.configs, args.kernels, args.also)
        for epi in args.epilogues:
            for c in (cfgs if epi == "none" else cfgs[:2]):
                jobs.append((m, k, n, epi, c.name, str(tmp / f"{len(jobs)}.so")))
        tc = sum(getattr(c, "mma", 0) for c in cfgs)
        print(f"{m}x{k}x{n}: {size} configs in the space ({tc} of the {len(cfgs)} timed on "
              f"tensor cores), default {default.name}", flush=True)
    bad = [(j, e) for j, (_, e) in zip(jobs, (_build(j, ptxas=True) for j in jobs)) if e is not None]
    for j, e in bad:
        print("FAILED", j[:5], e)
    print(f"dry run: built {len(jobs) - len(bad)} of {len(jobs)} kernels for CUDA (nvcc sm_90a, no spills)")
    if bad:
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="40", help="configs timed a shape besides the default: a number "
                    "(an even stride through the space) or 'all'")
    ap.add_argument("--sweep-epilogue", action="store_true", help="time every config with the epilogue too "
                    "(else the bias+SiLU rows time the default only)")
    ap.add_argument("--small", action="store_true", help="small shapes (a quick check)")
    ap.add_argument("--shapes", default="", help="MxKxN,... instead of the built-in shapes")
    ap.add_argument("--kernel", choices=("both", "cuda-cores", "tensor-cores"), default="both",
                    help="the sample's kernels (the default and each kernel's best by the rule are timed always)")
    ap.add_argument("--also", action="append", default=[], help="a config name timed too, at every shape it fits "
                    "({M} in it: the shape's rows; repeatable)")
    ap.add_argument("--top", type=int, default=0, help="print each shape's fastest N configs")
    ap.add_argument("--no-epilogue", action="store_true", help="skip the bias + SiLU rows")
    ap.add_argument("--dry-run", action="store_true", help="build the CUDA kernels only (no GPU)")
    args = ap.parse_args()
    args.kernels = {"both": (0, 1), "cuda-cores": (0,), "tensor-cores": (1,)}[args.kernel]
    args.epilogues = EPILOGUES[:1] if args.no_epilogue else EPILOGUES
    if args.shapes and not re.fullmatch(r"\d+x\d+x\d+(,\d+x\d+x\d+)*", args.shapes):
        sys.exit("--shapes: MxKxN[,MxKxN...], e.g. 16x4096x11008")
    if args.configs != "all" and not args.configs.isdigit():
        sys.exit("--configs: a number or 'all'")
    if args.dry_run:
        dry_run(args)
        return
    doc = run(args)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gemv_gpu.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
