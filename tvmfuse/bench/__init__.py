"""``tvmfuse bench``: the tuned build side by side with onnxruntime, stock TVM and PyTorch, in one run.

Every backend runs the same random inputs; each backend's outputs are compared with onnxruntime's (CPU)
where onnxruntime can run the model. Latency: ``median_ms`` and ``p90_ms`` over ``repeat`` timed
samples, each the mean of ``number`` back-to-back calls, synchronised once per sample for every backend (TVM's
``time_evaluator``; CUDA events around PyTorch's calls; a host clock around onnxruntime's), so that a GPU runs
every backend under the same load (its clock falls under sustained load). The samples are taken in rounds, one
sample of each backend a round, after every backend is built and warm: a machine whose load changes during the
run (a shared CPU ran onnxruntime's ResNet-50 at 8 ms, then 17) slows all of them alike, not whichever ran then.
On the CPU a sample starts once the other runtimes' threads stopped spinning (:func:`quiet`).
Torch baselines rebuild the ONNX graph with :mod:`tvmfuse.bench.torch_onnx` (no onnx2torch there);
an unsupported graph or a missing torch gives an entry with ``available: false`` and the reason.
"""
from __future__ import annotations

import dataclasses

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tvmfuse.errors import ModelError, headline

# torch.compile's modes, by backend name: the default; CUDA graphs (launch-bound models, batch 1, are compared
# fairly only against a graph-replaying baseline, as tvmfuse's own build replays one); Inductor's autotuning of
# GEMM templates without graphs
TORCH_MODES = {"torch-compile": None, "torch-compile-ro": "reduce-overhead",
               "torch-compile-max": "max-autotune-no-cudagraphs"}
BACKENDS = ("tvmfuse", "onnxruntime", "tvm-default", "torch-eager", *TORCH_MODES)


@dataclass
class BenchConfig:
    model: Path
    target: str = "auto"
    db: Path | None = Path("tuning_logs") / "tvmfuse.db"
    against: tuple[str, ...] = ("onnxruntime", "tvm-default", "torch")
    planner: str | None = None
    input_shapes: dict | None = None
    repeat: int = 30
    number: int = 5
    seed: int = 0
    verify: bool = True
    cuda_graph: bool = True
    precision: str = "model"
    threads: int | None = None   # TVM's runtime threads (None: the physical cores; tvmfuse.threads)
    # PyTorch's fp32 GEMMs and convs on a GPU in TF32: "auto" as the precision's math (tf32: on; fp32-strict: off;
    # otherwise PyTorch's defaults: convs on, matmuls off); "off": fp32 everywhere, the accuracy an fp32 tvmfuse
    # build keeps on Hopper (three TF32 products), where PyTorch's TF32 convs put ResNet-50 2.1e-2 off onnxruntime
    # against fp32's 1e-4 (H100, BENCHMARKS.md)
    torch_tf32: str = "auto"


# seconds between two CPU samples, at the least: after a call a runtime's worker threads spin for new work before
# they sleep, so a sample taken right after another runtime's ran on cores that runtime's threads still held:
# SqueezeNet's tvmfuse build timed 1.07 ms so against onnxruntime's 0.75 ms, and 0.74-1.05 ms alone (a user runs one
# runtime, not both). How long they spin differs by machine: onnxruntime's about 35 ms and TVM's 65 ms on the 2-core
# Xeon of BENCHMARKS.md, TVM's 150-170 ms on the 2-core AMD EPYC, where onnxruntime's SqueezeNet timed 0.70-0.90 ms
# right after TVM's calls and 0.32-0.40 ms 2 s later. So the gap goes on, in QUIET_STEP_S steps, until the process's
# threads burn less than QUIET_IDLE of a core in a step (or QUIET_MAX_S has passed)
QUIET_S = 0.1
QUIET_STEP_S = 0.02
QUIET_IDLE = 0.1
QUIET_MAX_S = 1.0
# and then runs untimed for this long, so its own threads and cores are awake, as in a model served back to back
# (after the gap alone, SqueezeNet's 5-call samples averaged 1.23 ms; with the warm-up 0.66 ms, minutes later)
WARM_S = 0.05


def quiet() -> float:
    """Sleep ``QUIET_S``, then on until this process's threads are idle (see ``QUIET_IDLE``); the seconds slept."""
    t0 = time.perf_counter()
    time.sleep(QUIET_S)
    while time.perf_counter() - t0 < QUIET_MAX_S:
        cpu = time.process_time()
        time.sleep(QUIET_STEP_S)
        if time.process_time() - cpu < QUIET_IDLE * QUIET_STEP_S:
            break
    return time.perf_counter() - t0


def settle(call) -> None:
    """Before a CPU sample: :func:`quiet`, then ``call`` repeated untimed for ``WARM_S``."""
    quiet()
    warm_until = time.perf_counter() + WARM_S
    while time.perf_counter() < warm_until:
        call()


def _stats(samples_s: list[float]) -> dict:
    arr = np.asarray(samples_s, dtype=np.float64) * 1e3
    return {"median_ms": float(np.median(arr)), "p90_ms": float(np.percentile(arr, 90)), "samples": int(arr.size)}


def call_samples(call, *, repeat: int, number: int, cuda: bool = False) -> list[float]:
    """``repeat`` samples of ``call``, each the mean seconds of ``number`` back-to-back calls, synchronised once per
    sample: between two CUDA events (``cuda``: PyTorch's current stream) or on the host clock (a call that
    synchronises itself, or a CPU one)."""
    samples = []
    for _ in range(repeat):
        if cuda:
            import torch

            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(number):
                call()
            e.record()
            e.synchronize()
            samples.append(s.elapsed_time(e) * 1e-3 / number)
        else:
            t0 = time.perf_counter()
            for _ in range(number):
                call()
            samples.append((time.perf_counter() - t0) / number)
    return samples


def time_vm(vm, args, dev, *, repeat: int, number: int) -> list[float]:
    vm["main"](*args)
    dev.sync()
    te = vm.time_evaluator("main", dev, number=number, repeat=repeat, min_repeat_ms=0)
    return [float(x) for x in te(*args).results]


def _sampler(call, cfg: BenchConfig, cuda: bool = False):
    """One timed sample of ``call`` (see :func:`call_samples`) each time it is called."""
    return lambda: call_samples(call, repeat=1, number=cfg.number, cuda=cuda)[0]


def _tvm_run(exe, target, feeds: list[np.ndarray], params: list, cfg: BenchConfig):
    """(outputs, sampler) of a Relax executable."""
    from tvmfuse._tvm import relax
    from tvmfuse.compile.build import on_device

    dev = target.tvm_device()
    vm = relax.VirtualMachine(exe, dev)
    args = on_device(feeds, dev) + on_device(params, dev)
    out = vm["main"](*args)
    from tvmfuse.runtime.loaded import _flatten

    outs = [t.numpy() for t in _flatten(out)]
    te = vm.time_evaluator("main", dev, number=cfg.number, repeat=1, min_repeat_ms=0)
    te(*args)   # warm-up, untimed
    return outs, lambda: float(te(*args).results[0])


def _ort(model_path, feeds: dict, gpu: bool, cfg: BenchConfig):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if cfg.threads:   # the same CPU threads as TVM's runtime (onnxruntime's default is the physical cores too)
        opts.intra_op_num_threads = int(cfg.threads)
    providers = ["CPUExecutionProvider"]
    if gpu and "CUDAExecutionProvider" in ort.get_available_providers():
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    sess = ort.InferenceSession(model_path, sess_options=opts, providers=providers)
    on_gpu = providers[0] == "CUDAExecutionProvider"
    if on_gpu:  # inputs and outputs stay on the device: time the model, not host copies
        binding = sess.io_binding()
        for name, arr in feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr, "cuda", 0))
        for o in sess.get_outputs():
            binding.bind_output(o.name, "cuda")

        def call():
            sess.run_with_iobinding(binding)
            binding.synchronize_outputs()
        call()
        outs = [np.asarray(v) for v in binding.copy_outputs_to_cpu()]
    else:
        def call():
            return sess.run(None, feeds)
        outs = [np.asarray(v) for v in call()]
    for _ in range(2):
        call()
    return outs, _sampler(call, cfg), providers[0]


def torch_tf32(cfg: BenchConfig) -> bool | None:
    """Whether PyTorch's fp32 GEMMs and convs run in TF32 on a GPU (None: PyTorch's defaults) for ``cfg``."""
    if cfg.torch_tf32 in ("on", "off"):
        return cfg.torch_tf32 == "on"
    # the same math as tvmfuse's: tf32's GEMMs and convs in TF32; fp32-strict's nowhere (PyTorch's convs default to it)
    return {"tf32": True, "fp32-strict": False}.get(cfg.precision)


def _torch(model, feeds: list[np.ndarray], gpu: bool, cfg: BenchConfig, compiled: bool, mode: str | None = None):
    import torch

    from tvmfuse.bench.torch_onnx import build_fn

    device = "cuda" if gpu and torch.cuda.is_available() else "cpu"
    tf32 = torch_tf32(cfg)
    if device == "cuda" and tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    fn = build_fn(model, device)
    if compiled:
        fn = torch.compile(fn, mode=mode)
    args = [torch.from_numpy(a).to(device) for a in feeds]
    with torch.no_grad():
        outs = [o.detach().cpu().numpy() for o in fn(*args)]
        for _ in range(3):
            fn(*args)
    one_sample = _sampler(lambda: fn(*args), cfg, cuda=device == "cuda")

    def sample():   # autograd off around the sample's calls, not inside each timed call
        with torch.no_grad():
            return one_sample()
    return outs, sample


def _torch_tf32() -> dict:
    """Whether PyTorch ran fp32 GEMMs and convs in TF32 (its defaults: convs yes, matmuls no), on a GPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"tf32": {"matmul": bool(torch.backends.cuda.matmul.allow_tf32),
                     "conv": bool(torch.backends.cudnn.allow_tf32)}}


def run_bench(cfg: BenchConfig) -> dict:
    """Build and time every requested backend on one set of random inputs; see module docstring."""
    from tvmfuse.threads import apply_threads

    if cfg.torch_tf32 not in ("auto", "on", "off"):
        from tvmfuse.errors import TvmfuseError

        raise TvmfuseError(f"--torch-tf32 {cfg.torch_tf32!r}: auto, on or off")
    threads = apply_threads(cfg.threads)   # before TVM runs anything in this process
    cfg = dataclasses.replace(cfg, threads=threads)
    from tvmfuse import verify
    from tvmfuse.frontend.precision import TOLERANCE as PRECISION_TOLERANCE
    from tvmfuse._tvm import tvm
    from tvmfuse.compile.model_check import build_checked
    from tvmfuse.db import open_database
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.plan.partition import DEFAULT_PLANNER
    from tvmfuse.target import resolve_target

    against = set()
    for a in cfg.against:
        a = a.strip()
        if not a:
            continue
        if a == "torch":
            against.update({"torch-eager", "torch-compile"})
        elif a == "torch-all":
            against.update({"torch-eager", *TORCH_MODES})
        elif a in BACKENDS:
            against.add(a)
        else:
            from tvmfuse.errors import TvmfuseError

            raise TvmfuseError(f"unknown backend '{a}'", hint="choose from onnxruntime, tvm-default, torch, "
                               "torch-all, " + ", ".join(BACKENDS[3:]))
    target = resolve_target(cfg.target)
    loaded = load_model(cfg.model, input_shapes=cfg.input_shapes or {}, precision=cfg.precision)
    feeds_d = verify.random_inputs(loaded.inputs, seed=cfg.seed)
    names = [s["name"] if isinstance(s, dict) else s.name for s in loaded.inputs]
    feeds = [feeds_d[n] for n in names]
    results: list[dict] = []
    outputs: dict[str, list] = {}
    report: dict = {"model": str(cfg.model), "target": target.canonical, "device": target.device, "threads": threads,
                    "calls_per_sample": cfg.number, "results": results}

    mod = import_model(loaded)
    t0 = time.perf_counter()
    fused, plan = partition(mod, target=target, planner=cfg.planner or DEFAULT_PLANNER, precision=cfg.precision)
    db = None
    if cfg.db is not None and Path(cfg.db).exists():
        db = open_database(cfg.db, target=target, create=False)
    try:
        built, end_to_end = build_checked(fused, target=target, database=db, cuda_graph=cfg.cuda_graph)
    finally:
        if db is not None:
            db.close()
    report["tvmfuse_build"] = {"seconds": round(time.perf_counter() - t0, 2), "planner": plan.planner,
                               "kernels": [k.to_json() for k in built.kernels], "untuned": built.untuned,
                               "db": str(cfg.db) if db is not None else None, "cuda_graph": built.cuda_graph,
                               "end_to_end_check": end_to_end}
    samplers: dict = {}   # backend -> one timed sample a call; the rounds below take them in turn
    try:
        outs, samplers["tvmfuse"] = _tvm_run(built.executable, target, feeds, list(built.lifted_params), cfg)
        outputs["tvmfuse"] = outs
        results.append({"backend": "tvmfuse", "untuned_kernels": len(built.untuned), "cuda_graph": built.cuda_graph})
    except Exception as err:  # noqa: BLE001 - a build that does not run: its row says why, the baselines still run
        # (LLaMA at 8 x 512 on the H200: a kernel the GPU refused to launch ended the whole bench, baselines too)
        results.append({**_unavailable("tvmfuse", err), "untuned_kernels": len(built.untuned),
                        "cuda_graph": built.cuda_graph})

    if "tvm-default" in against:
        t0 = time.perf_counter()
        try:
            with target.target:
                exe = tvm.compile(mod, target.target)
            outs, samplers["tvm-default"] = _tvm_run(exe, target, feeds, [], cfg)
            outputs["tvm-default"] = outs
            results.append({"backend": "tvm-default", "build_s": round(time.perf_counter() - t0, 2)})
        except Exception as err:  # noqa: BLE001 - a baseline that fails is reported, not fatal
            results.append(_unavailable("tvm-default", err))
    if "onnxruntime" in against:
        try:
            outs, samplers["onnxruntime"], provider = _ort(loaded.proto.SerializeToString(), feeds_d, target.is_gpu,
                                                           cfg)
            outputs["onnxruntime"] = outs
            results.append({"backend": "onnxruntime", "provider": provider})
        except Exception as err:  # noqa: BLE001
            results.append(_unavailable("onnxruntime", err))
    for name, compiled, mode in (("torch-eager", False, None), *((n, True, m) for n, m in TORCH_MODES.items())):
        if name not in against:
            continue
        try:
            outs, samplers[name] = _torch(loaded.proto, feeds, target.is_gpu, cfg, compiled, mode)
            outputs[name] = outs
            results.append({"backend": name, **_torch_tf32()})
        except ImportError:
            results.append({"backend": name, "median_ms": None, "p90_ms": None, "available": False,
                            "reason": "torch is not importable here"})
        except Exception as err:  # noqa: BLE001
            results.append(_unavailable(name, err))

    samples: dict = {name: [] for name in samplers}
    failed: dict = {}
    # on the CPU each sample starts once the other runtimes' pools have stopped spinning (see QUIET_S)
    quiet = QUIET_S > 0 and not target.is_gpu and len(samplers) > 1
    for _ in range(cfg.repeat):
        for name, sample in list(samplers.items()):
            try:
                if quiet:
                    settle(sample)
                samples[name].append(sample())
            except Exception as err:  # noqa: BLE001 - a backend that fails while timed is reported, not fatal
                failed[name] = _unavailable(name, err)
                del samplers[name]
    for i, r in enumerate(results):
        if r["backend"] in failed:
            results[i] = failed[r["backend"]]
        elif r["backend"] in samples:
            r.update(_stats(samples[r["backend"]]))
    if cfg.verify:
        try:
            refs = verify.run_onnxruntime(loaded.path, feeds_d)
        except Exception as err:  # noqa: BLE001
            refs = None
            report["verification"] = {"reference": None, "reason": str(err)[:200]}
        if refs is not None:
            out_names = [s["name"] if isinstance(s, dict) else s.name for s in loaded.outputs]
            loose = PRECISION_TOLERANCE.get(cfg.precision, 0.0)
            if verify.is_quantized(loaded.proto):
                floor = verify.quantization_floor(loaded.path, feeds_d, refs)
                loose = max(loose, verify.QUANTIZED_SLACK * floor)
                report["verification"] = {"quantization_floor": floor, "slack": verify.QUANTIZED_SLACK,
                                          "degenerate_scales": verify.degenerate_scales(loaded.proto)}
            tf32 = None
            if cfg.precision == "tf32":
                try:
                    tf32 = {"tf32_floor": verify.tf32_floor(loaded.proto, feeds_d, refs),
                            "tf32_slack": verify.TF32_SLACK}
                    loose = max(loose, verify.TF32_SLACK * tf32["tf32_floor"])
                except ModelError as err:   # no floor: the tolerance stands, and the report says why
                    tf32 = {"tf32_floor": None, "tf32_floor_reason": str(err)}
            for r in results:
                got = outputs.get(r["backend"])
                if got is None:
                    continue
                checks = verify.compare(got, refs, out_names, min_tolerance=loose)
                r["rel_error"] = max(c.rel_error for c in checks)
                r["ok"] = all(c.ok for c in checks)
            if cfg.precision in PRECISION_TOLERANCE:
                report["verification"] = precision_floor(results)
            if tf32 is not None:
                report["verification"].update(tf32)
    return report


# a reduced-precision build is held to the error of a plain implementation of the same converted graph where that
# error is above the dtype's tolerance: a deep random-weight CNN in fp16 is 1-7e-2 off the fp32 reference on every
# backend (torch eager, inductor, tvmfuse alike), which is the graph's own fp16 error and says nothing of a kernel
FLOOR_BACKENDS = ("torch-eager", "onnxruntime")
FLOOR_SLACK = 1.25


def precision_floor(results: list[dict]) -> dict:
    """Mark each backend's result ``ok`` that misses the dtype's tolerance but stays within ``FLOOR_SLACK`` times the
    error of the first plain implementation in ``FLOOR_BACKENDS`` that ran the same converted graph (``floor``:
    True on it); returns what the floor was, or why there was none."""
    by_name = {r["backend"]: r for r in results}
    ref = next((by_name[n] for n in FLOOR_BACKENDS if by_name.get(n, {}).get("rel_error") is not None), None)
    if ref is None:
        return {"floor": None, "reason": "no plain implementation of the converted graph ran (torch-eager, "
                                         "onnxruntime)"}
    bound = FLOOR_SLACK * ref["rel_error"]
    for r in results:
        if r.get("ok") is False and r["backend"] != ref["backend"] and r["rel_error"] <= bound:
            r["ok"], r["floor"] = True, True
    return {"floor": {"backend": ref["backend"], "rel_error": ref["rel_error"], "slack": FLOOR_SLACK}}


def _unavailable(backend: str, err: Exception) -> dict:
    return {"backend": backend, "median_ms": None, "p90_ms": None, "available": False, "reason": headline(err)}
