"""benchmarks/bench_convergence.py's shapes and measures (the sweep itself runs on the H200; its ``--small
--target llvm`` smoke run and its CUDA ``--dry-run`` are run by hand, see the report)."""
from __future__ import annotations

import math

import pytest

from benchmarks.bench_convergence import CLASSES, draw_shapes, main, summarize, trials_to


def test_shapes_are_drawn_from_the_seed_within_the_briefs_ranges():
    assert draw_shapes("gemm", 30, 0, False) == draw_shapes("gemm", 30, 0, False)
    assert draw_shapes("gemm", 30, 0, False) != draw_shapes("gemm", 30, 1, False)
    gemms = draw_shapes("gemm", 60, 0, False)
    dims = [s[k] for s in gemms for k in "MNK"]
    assert min(dims) >= 64 and max(dims) <= 16384
    assert any(d % 128 for d in dims) and any(d % 128 == 0 for d in dims)   # non-multiples of 128 among them
    rows = draw_shapes("rows", 60, 0, False)
    assert all(64 <= s["N"] <= 65536 for s in rows) and {s["case"] for s in rows} == {"softmax", "layernorm", "rmsnorm"}
    assert max(s["N"] for s in rows) > 16384   # wide rows (streamed) are drawn too
    for cls in CLASSES:
        assert len(draw_shapes(cls, 3, 0, True)) == 3


def test_trials_to_counts_the_default_as_trial_zero():
    times = [10.0, 12.0, 5.0, 4.6, 4.0]
    assert trials_to(times, 4.0, 0.90) == 4 and trials_to(times, 4.0, 0.80) == 2
    assert trials_to([4.0, math.inf], 4.0, 0.95) == 0
    assert trials_to([9.0, math.inf], 4.0, 0.95) is None


def test_the_summary_counts_a_never_reached_target_past_the_budget():
    entry = {"class": "gemm", "best_ms": 1.0, "default_ms": 2.0,
             "random": {"trials_to_90": None, "trials_to_95": None, "best_ms": 1.5},
             "tvmfuse": {"trials_to_90": 3, "trials_to_95": 5, "best_ms": 1.0, "default": "model (40 records)"}}
    (row,) = summarize({"a": entry}, ["gemm"], 16)
    assert row == ["gemm", 1, 17, 17, "0/1", 3, 5, "1/1", "0/1", "1/1"]


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    assert main(["--classes", "gemm,nope"]) == 2
    assert "unknown class 'nope'" in capsys.readouterr().err
    assert main(["--trials", "0"]) == 2
