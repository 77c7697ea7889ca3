"""The library calls behind the CLI: ``tune``, ``compile``, ``run``. A notebook calls these directly.

Each takes keyword arguments, returns a JSON-ready report dict, and raises ``TvmfuseError`` subclasses for
anything a user can fix.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tvmfuse import verify
from tvmfuse.db import open_database
from tvmfuse.errors import VerificationError
from tvmfuse.frontend import import_model, load_model
from tvmfuse.frontend.precision import TOLERANCE as PRECISION_TOLERANCE
from tvmfuse.plan import partition
from tvmfuse.plan.partition import DEFAULT_PLANNER
from tvmfuse.target import resolve_target
from tvmfuse.tune import TuneConfig, TuneProgress, extract_kernels, tune_kernels

DEFAULT_DB = Path("tuning_logs") / "tvmfuse.db"
EXAMPLE_MODEL = Path(__file__).parent / "data" / "example.onnx"


@dataclass(frozen=True)
class ModelConfig:
    """What every model command shares: the model, its input shapes, the target, the planner, the database."""

    model: Path
    target: str = "auto"
    db: Path = DEFAULT_DB
    planner: str = DEFAULT_PLANNER
    input_shapes: dict = field(default_factory=dict)
    precision: str = "model"  # model | fp32 | fp16 (tvmfuse.frontend.precision)


def _prepare(cfg: ModelConfig):
    target = resolve_target(cfg.target)
    loaded = load_model(cfg.model, input_shapes=cfg.input_shapes, precision=cfg.precision)
    mod = import_model(loaded)
    fused, plan = partition(mod, target=target, planner=cfg.planner)
    return target, loaded, fused, plan


def tune(cfg: ModelConfig, tune_cfg: TuneConfig, *, progress: TuneProgress | None = None) -> dict:
    """Partition the model, extract one task per fused kernel, tune within the budget into ``cfg.db``."""
    t0 = time.perf_counter()
    target, loaded, fused, plan = _prepare(cfg)
    kernels = extract_kernels(fused, target=target)
    db = open_database(cfg.db, target=target)
    try:
        results = tune_kernels(kernels, target=target, database=db, config=tune_cfg, progress=progress,
                               model=loaded.name)
    finally:
        db.close()
    return {
        "model": str(cfg.model), "target": target.canonical, "device": target.device, "db": str(cfg.db),
        "planner": plan.planner, "precision": cfg.precision, "kernels": [r.to_json() for r in results],
        "trials_run": sum(r.trials_run for r in results),
        "default_schedules_measured": sum(r.baseline_s is not None for r in results),
        "failed": [r.name for r in results if r.status == "failed"],
        "seconds": round(time.perf_counter() - t0, 2),
    }


def compile(cfg: ModelConfig, *, out: Path, untuned: bool = False, cuda_graph: bool = True) -> dict:  # noqa: A001
    """Apply the best records for the target and export an artifact folder to ``out`` (``cuda_graph``: on a GPU,
    the model replays as one CUDA graph; see ``tvmfuse.compile.build``)."""
    from tvmfuse.compile import build, export_artifact

    t0 = time.perf_counter()
    target, loaded, fused, plan = _prepare(cfg)
    use_db = not untuned and Path(cfg.db).exists()
    db = open_database(cfg.db, target=target, create=False) if use_db else None
    try:
        result = build(fused, target=target, database=db, cuda_graph=cuda_graph)
    finally:
        if db is not None:
            db.close()
    export_artifact(result, out, target=target, inputs=loaded.inputs, outputs=loaded.outputs,
                    model_path=cfg.model, planner=plan.planner,
                    extra={"cuda_graph": result.cuda_graph, "precision": cfg.precision})
    return {
        "artifact": str(out), "target": target.canonical, "device": target.device, "planner": plan.planner,
        "precision": cfg.precision,
        "kernels": [k.to_json() for k in result.kernels],
        "db": str(cfg.db) if use_db else None, "untuned": result.untuned, "cuda_graph": result.cuda_graph,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def run(artifact: Path, *, inputs: Path | None = None, verify_against: Path | None = None,
        repeat: int = 20, seed: int = 0) -> dict:
    """Run an artifact: latency (median, p90) and, with ``verify_against``, relative error vs onnxruntime.

    Raises :class:`VerificationError` (exit 1) when any output is beyond its dtype's tolerance.
    """
    from tvmfuse.runtime import load_artifact

    art = load_artifact(artifact)
    feeds = verify.load_inputs(inputs, art.input_specs) if inputs else verify.random_inputs(art.input_specs, seed=seed)
    outputs = art.run(feeds)
    report: dict = {"artifact": str(artifact), "device": art.manifest.get("device"),
                    "outputs": [{"name": s["name"], "shape": list(o.shape), "dtype": str(o.dtype)}
                                for s, o in zip(art.output_specs, outputs)]}
    if repeat > 0:
        times = np.array(art.benchmark(feeds, repeat=repeat)) * 1e3
        report["latency_ms"] = {"median": float(np.median(times)), "p90": float(np.percentile(times, 90)),
                                "min": float(times.min()), "repeat": repeat}
    if verify_against is not None:
        model = load_model(verify_against, input_shapes={s["name"]: tuple(s["shape"]) for s in art.input_specs})
        refs = verify.run_onnxruntime(model.path, feeds)
        # an artifact compiled below its model's precision (--precision fp16) is held to that precision's tolerance
        loose = PRECISION_TOLERANCE.get(art.manifest.get("precision", "model"), 0.0)
        checks = verify.compare(outputs, refs, [s["name"] for s in art.output_specs], min_tolerance=loose)
        report["verification"] = {"reference": "onnxruntime", "outputs": [c.to_json() for c in checks],
                                  "ok": all(c.ok for c in checks)}
        if not report["verification"]["ok"]:
            worst = max(checks, key=lambda c: c.rel_error / max(c.tolerance, 1e-30))
            err = VerificationError(f"output '{worst.name}' differs from onnxruntime: relative error "
                                    f"{worst.rel_error:.3g} > {worst.tolerance:g}")
            err.report = report
            raise err
    return report
