from dataclasses import dataclass

import pytest

from tvmfuse.tune import TuneConfig
from tvmfuse.tune.tuner import allocate_budget


@dataclass
class _K:
    flops: float
    weight: int = 1


def test_budget_gives_every_kernel_a_share_then_favours_heavy_kernels():
    kernels = [_K(10), _K(1000), _K(100)]
    b = allocate_budget(kernels, [0, 0, 0], TuneConfig(trials=10, trials_per_kernel=8))
    assert sum(b) == 10 and min(b) >= 3
    assert b[1] == max(b)  # the leftover trial goes to the heaviest kernel


def test_budget_respects_what_the_database_already_spent():
    kernels = [_K(1), _K(1)]
    assert allocate_budget(kernels, [8, 3], TuneConfig(trials=100, trials_per_kernel=8)) == [0, 5]
    assert allocate_budget(kernels, [8, 8], TuneConfig(trials=100, trials_per_kernel=8)) == [0, 0]
    assert allocate_budget(kernels, [8, 8], TuneConfig(trials=4, trials_per_kernel=8, retune=True)) == [2, 2]


def test_budget_zero_trials_tunes_nothing():
    assert allocate_budget([_K(1)], [0], TuneConfig(trials=0)) == [0]


@pytest.mark.slow
def test_tuning_records_every_kernel(tuned_example):
    _, report = tuned_example
    assert len(report["kernels"]) >= 5
    assert not report["failed"]
    for k in report["kernels"]:
        assert k["status"] == "tuned", k
        assert k["trials_run"] >= 1
        assert k["best_ms"] is not None and k["best_ms"] > 0


@pytest.mark.slow
def test_second_tune_resumes_and_spends_nothing_on_tuned_kernels(tuned_example):
    from tvmfuse import api

    cfg, first = tuned_example
    again = api.tune(cfg, TuneConfig(trials=14, trials_per_kernel=2))
    assert again["trials_run"] == 0
    # a kernel whose tiny design space ran out before its budget is tried again and reported "exhausted"
    assert {k["status"] for k in again["kernels"]} <= {"skipped-spent", "exhausted"}
    assert [k["trials_before"] for k in again["kernels"]] == [k["trials_run"] for k in first["kernels"]]
