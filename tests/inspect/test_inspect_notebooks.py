"""The notebooks run top to bottom against a freshly tuned database and write their PNG plots."""
from __future__ import annotations

import asyncio
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


async def _execute_all(paths: list[Path]) -> dict:
    # both kernels at once: on 2 cores their start-up and imports overlap with each other's waits
    results = await asyncio.gather(*(_client(p).async_execute() for p in paths), return_exceptions=True)
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
