"""`tvmfuse tune`'s progress: searched trials counted against --trials (default schedules apart), an ETA, plain lines
written as they happen when stderr is piped, the table's order, and what a time-bounded run leaves to do."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tvmfuse.cli.main import TABLE_ORDER, _table_order
from tvmfuse.cli.progress import RichProgress, TrialCount

EXAMPLE = Path(__file__).resolve().parents[2] / "tvmfuse" / "data" / "example.onnx"


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_trial_count_counts_searched_trials_only_and_estimates_the_time_left():
    clock = _Clock()
    count = TrialCount(clock=clock)
    count.start(3, [16, 8, 8])  # what the tuner passes: searched trials only, summing to --trials (32)
    assert (count.total, count.done, count.eta()) == (32, 0, None)  # nothing measured: no estimate yet
    count.default(0)  # kernel 0's default schedule: measured, but not a trial
    clock.t += 10
    assert (count.done, count.defaults, count.eta()) == (0, 1, None)
    count.batch(0, 8)
    count.batch(0, 16)
    assert (count.done, count.total) == (16, 32)
    assert count.eta() == pytest.approx(10 / 16 * 16)  # mean time per searched trial x trials left
    count.kernel_done(0)
    count.default(1)
    count.default(1)  # reported twice (two passes): still one default schedule
    count.batch(1, 3)
    count.kernel_done(1)  # ended below its budget (space exhausted, failed, time up): the rest is given back
    assert (count.done, count.total, count.defaults) == (19, 27, 2)
    count.kernel_done(2)  # skipped: its 8 trials will never be measured
    assert (count.done, count.total, count.kernels_done) == (19, 19, 3)
    assert count.eta() == 0.0


def test_trial_count_eta_never_exceeds_the_time_budget():
    clock = _Clock()
    count = TrialCount(time_budget_s=60, clock=clock)
    count.start(2, [10, 10])
    assert count.eta() == 60  # before any trial: the budget is all that is known
    clock.t += 20
    count.batch(0, 2)  # 10 s a trial, 18 left: 180 s, but the budget ends in 40
    assert count.eta() == pytest.approx(40)
    clock.t += 100
    assert count.eta() == 0.0


def test_piped_progress_is_one_line_per_finished_kernel(capsys):
    progress = RichProgress(enabled=True, live=False)
    kernels = [SimpleNamespace(name="fused_a"), SimpleNamespace(name="fused_b")]
    with progress:
        progress.on_start(kernels, [2, 0])
        progress.on_default(0, 1e-5)
        progress.on_batch(0, 2, 5e-6)
        progress.on_kernel_done(0, SimpleNamespace(name="fused_a", status="tuned", best_s=5e-6))
        progress.on_kernel_done(1, SimpleNamespace(name="fused_b", status="skipped-budget", best_s=None))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("tuning 2 kernels: up to 2 trials")
    assert lines[1].startswith("[1/2] fused_a: tuned, 2 trials + default, best 5.0 µs; 2/2 trials, ")
    assert lines[2].startswith("[2/2] fused_b: skipped-budget, 0 trials, best -; 2/2 trials, ")
    assert all("elapsed, ETA " in line for line in lines[1:]) and len(lines) == 3


def test_piped_progress_says_how_a_long_kernel_goes_when_no_line_came_for_a_while(capsys):
    progress = RichProgress(enabled=True, live=False)
    clock = progress.count.clock = _Clock()
    progress.on_start([SimpleNamespace(name="fused_slow")], [64])
    progress.on_batch(0, 8, 2e-3)  # too soon after the first line: nothing
    clock.t += progress.HEARTBEAT_S
    progress.on_batch(0, 16, 1e-3)
    clock.t += 1
    progress.on_batch(0, 24, 1e-3)  # just after a line: nothing
    lines = capsys.readouterr().err.splitlines()
    assert lines[1:] == ["  fused_slow: tuning, 16 of its 64 trials, best 1.000 ms; 16/64 trials, 30 s elapsed, "
                         "ETA 2 min"], lines


def test_table_order_groups_by_status_then_model_time():
    def k(name, status, weight, best_ms, baseline_ms=None):
        return {"name": name, "status": status, "weight": weight, "best_ms": best_ms, "baseline_ms": baseline_ms}

    kernels = [k("skip_heavy", "skipped-spent", 1, 90.0), k("tuned_light", "tuned", 1, 1.0),
               k("tuned_called_often", "tuned", 12, 0.5), k("failed", "failed", 1, None),
               k("resumed_mid", "resumed", 2, 2.0), k("time_left", "skipped-time", 1, None, 3.0),
               k("interrupted", "interrupted", 1, 0.1), k("exhausted", "exhausted", 1, 1.0)]
    assert [x["name"] for x in _table_order(kernels)] == [
        "failed", "tuned_called_often", "resumed_mid", "tuned_light", "interrupted",
        "skip_heavy", "time_left", "exhausted"]
    assert "failed" in TABLE_ORDER and "calls x best time" in TABLE_ORDER


def _tune(db: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tvmfuse.cli.main", "tune", str(EXAMPLE), "--target", "llvm", "--db", str(db), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "250"})


def _read_stderr_live(proc: subprocess.Popen, timeout: float = 600):
    """stderr lines as they arrive, each with whether the process was still running then; and stdout."""
    lines: list[tuple[str, bool]] = []
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.append(proc.stdout.read()), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    for line in proc.stderr:
        lines.append((line.rstrip("\n"), proc.poll() is None))
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("tune took too long:\n" + "\n".join(l for l, _ in lines))
    proc.wait(timeout=60)
    reader.join(timeout=60)
    return lines, "".join(stdout)


# the three runs of the tests below, started at once: most of each is starting Python and planning the example, which
# overlaps on two cores (each run still has a database of its own)
# (the run of --trials is the suite's CLI run with the default XGBoost model; the others' model is never asked)
RUNS = {"trials": ["--trials", "2", "--trials-per-kernel", "2"],
        "time-bounded": ["--trials", "12", "--trials-per-kernel", "2", "--time-budget", "0.01", "--cost-model", "random"],
        "time-bounded-json": ["--trials-per-kernel", "2", "--time-budget", "0.01", "--json", "--cost-model", "random"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (return code, [(stderr line, whether tune was still running then)], stdout, db)} of each of RUNS."""
    work = tmp_path_factory.mktemp("progress")
    started = {name: (_tune(work / f"{name}.db", *args), work / f"{name}.db") for name, args in RUNS.items()}
    done: dict = {}

    def collect(name):
        proc, db = started[name]
        try:
            lines, stdout = _read_stderr_live(proc)
            done[name] = (proc.returncode, lines, stdout, db)
        except BaseException as e:  # pytest.fail in the reader: raised again in the test
            done[name] = e

    readers = [threading.Thread(target=collect, args=(name,), daemon=True) for name in started]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    return done


def _run(runs, name):
    if isinstance(runs[name], BaseException):
        raise runs[name]
    return runs[name]


@pytest.mark.slow
def test_piped_progress_lines_arrive_while_tuning_and_count_searched_trials(runs):
    """--trials 2 on a fresh database: the first two kernels get one searched trial each (after their default
    schedule, which is not a trial), the others none. Kernel 1's line comes while kernel 2 is being tuned."""
    returncode, lines, stdout, _ = _run(runs, "trials")
    assert returncode == 0, "\n".join(l for l, _ in lines)
    progress = [(l, live) for l, live in lines if l.startswith("[")]
    # the example's kernels on llvm (its planned kernels and, with convs run channels-last, their layout changes)
    head = re.match(r"tuning (\d+) kernels: up to 2 trials", lines[0][0])
    assert head is not None and int(head.group(1)) >= 4, lines
    n = int(head.group(1))
    assert [l.split("]")[0] for l, _ in progress] == [f"[{i}/{n}" for i in range(1, n + 1)], lines
    assert progress[0][1], "the first kernel's line came only after the process ended"
    first, second = progress[0][0], progress[1][0]
    assert ": tuned, 1 trial + default, " in first and "; 1/2 trials, " in first, first
    assert ": tuned, 1 trial + default, " in second and "; 2/2 trials, " in second, second
    assert all(": skipped-budget, 0 trials, " in l and "; 2/2 trials, " in l for l, _ in progress[2:]), progress
    assert "trials run" in stdout  # the table, on stdout, after


@pytest.mark.slow
def test_a_time_bounded_run_says_what_is_left_and_how_to_continue(runs):
    returncode, lines, stdout, db = _run(runs, "time-bounded")
    text = [l for l, _ in lines]
    assert returncode == 0, "\n".join(text)
    assert "skipped-time" in stdout
    left = next(l for l in text if "kernels left untuned" in l)
    m = re.search(r"(\d+) of (\d+) kernels left untuned", left)
    assert m is not None, left
    n, total = int(m.group(1)), int(m.group(2))
    assert n >= total - 1, left  # the budget ends before the second kernel, if not before the first
    assert sum(": skipped-time, " in l for l in text) == n
    assert text[-1] == "continue with: " + shlex.join(
        ["tvmfuse", "tune", str(EXAMPLE), "--target", "llvm", "--db", str(db), "--trials", "12",
         "--trials-per-kernel", "2", "--time-budget", "0.01", "--cost-model", "random"]), text


@pytest.mark.slow
def test_a_time_bounded_run_in_json_names_the_kernels_left_and_the_command(runs):
    import json

    returncode, lines, out, db = _run(runs, "time-bounded-json")
    err = "\n".join(l for l, _ in lines)
    assert returncode == 0, err
    report = json.loads(out)
    assert report["left_untuned"] == [k["name"] for k in report["kernels"] if k["status"] == "skipped-time"]
    assert len(report["left_untuned"]) >= 5
    assert report["resume"] == shlex.join(["tvmfuse", "tune", str(EXAMPLE), "--target", "llvm", "--db", str(db),
                                           "--trials-per-kernel", "2", "--time-budget", "0.01", "--cost-model",
                                           "random", "--json"])
    assert err.strip().splitlines()[-1] == f"continue with: {report['resume']}"
