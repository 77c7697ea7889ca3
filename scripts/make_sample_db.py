"""Make a small, real tuning database for the notebooks: the embedded example tuned for a few trials.

It calls :func:`tvmfuse.api.tune` on ``tvmfuse/data/example.onnx`` (llvm, this machine's cores), then
compiles and times the artifact once so the notebooks can compare the sum of kernel times with a
measured end-to-end time. Takes about a minute on 2 cores.

Usage: python scripts/make_sample_db.py [OUT_DIR] [--trials-per-kernel N]
Writes OUT_DIR/tvmfuse.db (default ``tuning_logs/sample``) and OUT_DIR/example.artifact.
Point the notebooks at it with ``TVMFUSE_DB=OUT_DIR/tvmfuse.db`` (their default is this path).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def make_sample_db(*, out_dir: Path, trials_per_kernel: int = 4, target: str = "llvm",
                   artifact: bool = True) -> dict:
    """Tune the example into ``out_dir/tvmfuse.db``; optionally build ``out_dir/example.artifact``.

    Returns
    -------
    dict
        ``{"db": path, "artifact": path or None, "tune": tune report}``
    """
    from tvmfuse import api
    from tvmfuse.tune import TuneConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = api.ModelConfig(model=api.EXAMPLE_MODEL, target=target, db=out_dir / "tvmfuse.db")
    report = api.tune(cfg, TuneConfig(trials=trials_per_kernel * 16, trials_per_kernel=trials_per_kernel,
                                      trials_per_round=2, population=16))
    art = None
    if artifact:
        art = out_dir / "example.artifact"
        api.compile(cfg, out=art)
    return {"db": str(cfg.db), "artifact": None if art is None else str(art), "tune": report}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?", type=Path, default=Path("tuning_logs") / "sample")
    ap.add_argument("--trials-per-kernel", type=int, default=4)
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--no-artifact", action="store_true")
    args = ap.parse_args(argv)
    res = make_sample_db(out_dir=args.out_dir, trials_per_kernel=args.trials_per_kernel, target=args.target,
                         artifact=not args.no_artifact)
    print(json.dumps({"db": res["db"], "artifact": res["artifact"], "trials_run": res["tune"]["trials_run"],
                      "seconds": res["tune"]["seconds"]}))


if __name__ == "__main__":
    main()
