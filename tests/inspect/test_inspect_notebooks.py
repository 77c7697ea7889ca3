"""The notebooks run top to bottom against a freshly tuned database and write their PNG plots; on a database
with little or nothing in it they still run, and say what they could not plot."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import struct
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
PLOTS = {
    "tuning_curves.ipynb": ["tuning_curves.png", "speedup.png"],
    "where_time_goes.ipynb": ["roofline.png", "time_by_pattern.png", "fused_vs_unfused_bytes.png"],
}


def _client(path: Path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    return NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})


_KERNEL_STARTS = 3


async def _execute(path: Path):
    # A kernel can die before it answers kernel_info when two start at once (jupyter_client picks its ZMQ ports
    # before binding them, and the two processes can pick the same one): that start is tried again, a failing
    # cell is not
    for attempt in range(_KERNEL_STARTS):
        try:
            return await _client(path).async_execute()
        except RuntimeError as e:
            if "before replying to kernel_info" not in str(e) or attempt == _KERNEL_STARTS - 1:
                raise
            await asyncio.sleep(1.0 + attempt)


async def _execute_all(paths: list[Path]) -> dict:
    # both kernels at once: on 2 cores their start-up and imports overlap with each other's waits
    results = await asyncio.gather(*(_execute(p) for p in paths), return_exceptions=True)
    return {p.name: r for p, r in zip(paths, results)}


@pytest.fixture(scope="module")
def executed(tuned_example, example_artifact, tmp_path_factory):
    """Every notebook run once against the session's tuned database: {name: notebook or exception}, plots dir."""
    cfg, _ = tuned_example
    art, _ = example_artifact
    plots = tmp_path_factory.mktemp("plots")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TVMFUSE_DB", str(cfg.db))
        mp.setenv("TVMFUSE_MODEL", str(cfg.model))
        mp.setenv("TVMFUSE_ARTIFACT", str(art))
        mp.setenv("TVMFUSE_PLOTS", str(plots))
        results = asyncio.run(_execute_all([NOTEBOOKS / n for n in sorted(PLOTS)]))
    return results, plots


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def test_every_notebook_is_tested():
    assert {p.name for p in NOTEBOOKS.glob("*.ipynb")} == set(PLOTS)


@pytest.mark.parametrize("name", sorted(PLOTS))
def test_notebook_runs_and_writes_plots(name, executed):
    results, plots = executed
    if isinstance(results[name], BaseException):
        raise results[name]  # a cell errored: CellExecutionError names the cell and its traceback
    for png in PLOTS[name]:
        f = plots / png
        assert f.exists(), f"{name} did not write {png}"
        w, h = _png_size(f)
        assert w >= 600 and h >= 300 and f.stat().st_size > 15_000, (png, w, h, f.stat().st_size)


def test_notebook_fails_on_a_missing_database(tmp_path, monkeypatch):
    from nbclient.exceptions import CellExecutionError

    monkeypatch.setenv("TVMFUSE_DB", str(tmp_path / "none.db"))
    monkeypatch.setenv("TVMFUSE_PLOTS", str(tmp_path / "plots"))
    with pytest.raises(CellExecutionError, match="make_sample_db.py"):
        _client(NOTEBOOKS / "tuning_curves.ipynb").execute()


# ---- databases with little or nothing in them ------------------------------------------------------------------
FAILING = "example-failing"  # model label of the kernel whose every trial failed (a view with no valid record)


@pytest.fixture(scope="module")
def partly_tuned(tmp_path_factory, example_model, llvm_target):
    """A real tiny tuning run of the example that leaves most of it untuned: the lightest computing kernel tuned (its
    default schedule and one searched trial), the next one measured under a runner timeout nothing meets (every
    trial failed; labelled ``FAILING``), the others registered without any trial. (db, kernels, failed name)."""
    from tvmfuse.db import open_database
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.tune import TuneConfig, extract_kernels, tune_kernels

    db_path = tmp_path_factory.mktemp("partly") / "tvmfuse.db"
    loaded = load_model(example_model)
    fused, _ = partition(import_model(loaded), target=llvm_target)
    # the lightest kernels that compute first (a layout change has no FLOPs: a roofline cannot place it)
    kernels = sorted(extract_kernels(fused, target=llvm_target), key=lambda k: (k.flops == 0, k.flops))
    one = TuneConfig(trials=1, trials_per_kernel=1, trials_per_round=1, population=16, cost_model="random")
    db = open_database(db_path, target=llvm_target)
    try:
        # one trial over every kernel: the first gets it, the others are registered with none
        tuned = tune_kernels(kernels, target=llvm_target, database=db, config=one, model=loaded.name)
        never = dataclasses.replace(one, runner_timeout_s=1e-3, baseline=False, check=False)
        failed = tune_kernels(kernels[1:2], target=llvm_target, database=db, config=never, model=FAILING)
    finally:
        db.close()
    statuses = [r.status for r in tuned]
    assert statuses == ["tuned"] + ["skipped-budget"] * (len(kernels) - 1), [r.to_json() for r in tuned]
    assert failed[0].status == "failed" and failed[0].trials_run >= 1, failed[0].to_json()
    return db_path, len(kernels), kernels[1].name


def _texts(nb) -> tuple[str, str]:
    """(everything the cells printed, the plain-text results they displayed)."""
    printed, shown = [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                printed.append(out["text"])
            elif out.get("output_type") == "execute_result":
                shown.append(out.get("data", {}).get("text/plain", ""))
    return "".join(printed), "\n".join(shown)


@pytest.fixture(scope="module")
def executed_sparse(partly_tuned, example_model, tmp_path_factory):
    """Both notebooks on four databases at once, without TVMFUSE_MODEL or TVMFUSE_ARTIFACT unless said: empty
    (only created), partly tuned, its kernel whose every trial failed (by model label), and the example's kernels
    registered for the CUDA target as ``tune`` does before its first trial (a GPU-style database: this machine
    cannot measure one). {(case, notebook): (notebook or exception, plots dir)}."""
    from tvmfuse.db import open_database, open_store
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.target import resolve_target
    from tvmfuse.tune import extract_kernels

    db, _, _ = partly_tuned
    work = tmp_path_factory.mktemp("sparse")
    open_store(work / "empty.db", create=True).close()
    cuda = resolve_target("cuda")
    loaded = load_model(example_model)
    gpu = open_database(work / "gpu.db", target=cuda)
    try:
        for k in extract_kernels(partition(import_model(loaded), target=cuda)[0], target=cuda):
            gpu.set_task_name(k.mod, k.name, model=loaded.name)
    finally:
        gpu.close()
    cases = {"empty": {"TVMFUSE_DB": work / "empty.db"}, "partly": {"TVMFUSE_DB": db},
             "failed": {"TVMFUSE_DB": db, "TVMFUSE_MODEL": FAILING}, "gpu": {"TVMFUSE_DB": work / "gpu.db"}}
    runs, keys = [], []
    for case, env in cases.items():
        for name in sorted(PLOTS):
            plots = work / "plots" / case / name
            nb = _client(NOTEBOOKS / name)
            runs.append((nb, {**{k: str(v) for k, v in env.items()}, "TVMFUSE_PLOTS": str(plots)}))
            keys.append((case, name, plots))
    results = asyncio.run(_execute_clients(runs))
    return {(case, name): (r if isinstance(r, BaseException) else nb.nb, plots)
            for (case, name, plots), (nb, _), r in zip(keys, runs, results)}


async def _execute_clients(runs) -> list:
    # every kernel at once, each started with its own environment: only the TVMFUSE_ variables a case sets
    env = {k: v for k, v in os.environ.items() if not k.startswith("TVMFUSE_")}
    return await asyncio.gather(*(c.async_execute(env={**env, **e}) for c, e in runs), return_exceptions=True)


def _ran(executed_sparse, case: str, name: str):
    nb, plots = executed_sparse[(case, name)]
    if isinstance(nb, BaseException):
        raise nb  # a cell errored: CellExecutionError names the cell and its traceback
    printed, shown = _texts(nb)
    return printed, shown, sorted(p.name for p in plots.glob("*.png"))


@pytest.mark.parametrize("name", sorted(PLOTS))
def test_notebook_on_an_empty_database_says_there_is_nothing(name, executed_sparse):
    printed, _, pngs = _ran(executed_sparse, "empty", name)
    assert "holds no workloads or records yet" in printed, printed
    assert printed.count("Nothing to plot") == len(PLOTS[name]), printed
    assert pngs == []


@pytest.mark.parametrize("name", sorted(PLOTS))
def test_notebook_on_a_partly_tuned_database(name, executed_sparse, partly_tuned):
    _, n, failed = partly_tuned
    printed, shown, pngs = _ran(executed_sparse, "partly", name)
    # no TVMFUSE_MODEL: the database tuned the embedded example, which the notebook then re-plans
    assert "example.onnx" in printed.splitlines()[0], printed
    assert f": 1 with a valid record, 1 whose every trial failed, {n - 2} without any trial" in printed, printed
    assert "memory_bytes" in shown and "hbm_bytes" not in shown, shown  # a CPU's traffic is not to HBM
    assert pngs == sorted(PLOTS[name]), (pngs, printed)  # the one tuned kernel is enough for every plot
    for png in pngs:
        _png_size(executed_sparse[("partly", name)][1] / png)
    if name == "tuning_curves.ipynb":
        assert f"Not plotted: 1 kernel(s) whose every trial failed ({failed}), {n - 2} without any trial" in printed


@pytest.mark.parametrize("name", sorted(PLOTS))
def test_notebook_when_every_trial_failed(name, executed_sparse, partly_tuned):
    _, _, failed = partly_tuned
    printed, _, pngs = _ran(executed_sparse, "failed", name)
    assert ": 0 with a valid record, 1 whose every trial failed, 0 without any trial" in printed, printed
    assert printed.count("Nothing to plot") == len(PLOTS[name]), printed
    assert pngs == []
    if name == "tuning_curves.ipynb":
        assert f"only failed trials: {failed})" in printed, printed


@pytest.mark.parametrize("name", sorted(PLOTS))
def test_notebook_on_a_gpu_style_database(name, executed_sparse):
    printed, shown, pngs = _ran(executed_sparse, "gpu", name)
    assert "example.onnx" in printed.splitlines()[0], printed  # re-planned for CUDA, as it was tuned
    assert ": 0 with a valid record, 0 whose every trial failed, " in printed, printed
    assert "hbm_bytes" in shown, shown  # a GPU kernel's traffic is to HBM
    assert printed.count("Nothing to plot") == len(PLOTS[name]) - (name == "where_time_goes.ipynb"), printed
    assert pngs == (["fused_vs_unfused_bytes.png"] if name == "where_time_goes.ipynb" else []), pngs  # from the plan
