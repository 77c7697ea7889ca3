"""The default a template kernel is measured at first (tvmfuse/tune/model_default.py): the hand rule with no
records of its template, and with records of the template at other shapes in a real tvmfuse database (SQLite,
written here by hand, CUDA target: built for, never run), the config the run's XGBoost model, warm-started from
them, ranks first: a choice that follows the data."""
from __future__ import annotations

import tempfile
from pathlib import Path

import onnx
import pytest

from tvmfuse._tvm import ms
from tvmfuse.bench.cases import CASES
from tvmfuse.db import open_database
from tvmfuse.frontend import import_model, load_model
from tvmfuse.kernels import get
from tvmfuse.kernels.rows import parse_config
from tvmfuse.plan import partition
from tvmfuse.target import resolve_target
from tvmfuse.tune import extract_kernels
from tvmfuse.tune.cost_model import make_cost_model
from tvmfuse.tune.defaults import config_schedule
from tvmfuse.tune.features import config_name
from tvmfuse.tune.model_default import model_default, template_records
from tvmfuse.tune.spaces import classify
from tvmfuse.tune.warm_start import warm_start

CUDA = resolve_target("cuda")
ROWS = get("rows").candidates_key


def _softmax(m, n):
    path = Path(tempfile.mkdtemp()) / "softmax.onnx"
    onnx.save(CASES["softmax"](M=m, N=n)[0], path)
    fused, _ = partition(import_model(load_model(path)), target=CUDA)
    (k,) = [k for k in extract_kernels(fused, target=CUDA) if classify(k.mod["main"]) == "row_reduction"]
    return k


def _config_traces(kernel) -> list:
    """(config, trace) of every row-program config of ``kernel``: its scheduled kernels, as records hold them."""
    sch0 = config_schedule(kernel.mod, CUDA.target, "rows", lambda names: 0)
    names = str(sch0.mod["main"].body.block.annotations[ROWS]).split(";")
    return [(parse_config(name), config_schedule(kernel.mod, CUDA.target, "rows", lambda _, i=i: i).trace)
            for i, name in enumerate(names)]


def _write_records(db, kernel, traces, seconds_of) -> int:
    """One record per row-program config of ``kernel`` (``traces``: its ``_config_traces``), timed
    ``seconds_of(config)``; how many."""
    workload = db.ms_database.commit_workload(kernel.mod)
    args = ms.arg_info.ArgInfo.from_prim_func(kernel.mod["main"])
    for cfg, trace in traces:
        db.ms_database.commit_tuning_record(ms.database.TuningRecord(
            trace, workload, [seconds_of(cfg)], CUDA.target, args))
    return len(traces)


@pytest.fixture(scope="module")
def kernels():
    # scheduling every config is most of the cost of writing records: done once here, the tests only time them
    seen = [_softmax(64, 2048), _softmax(128, 1024), _softmax(32, 4096)]
    return {"new": _softmax(256, 4096), "seen": seen, "traces": [_config_traces(k) for k in seen]}


def _default(kernels, tmp_path, seconds_of):
    db = open_database(tmp_path / "t.db", target=CUDA)
    try:
        written = (sum(_write_records(db, k, t, seconds_of) for k, t in zip(kernels["seen"], kernels["traces"]))
                   if seconds_of else 0)
        model = make_cost_model("xgb")
        warm_start(model, db, CUDA)
        sch, source = model_default(kernels["new"].mod, CUDA, cost_model=model, database=db)
        return config_name(sch.mod["main"]), source, written
    finally:
        db.close()


def test_no_records_of_the_template_keep_the_hand_rule(kernels, tmp_path):
    (template, name), source, _ = _default(kernels, tmp_path, None)
    assert (template, source) == ("rows", "rule")


@pytest.mark.slow   # the model warm-started on three shapes' records, once per case
@pytest.mark.parametrize("fast_threads", [128, 512])
def test_the_default_is_the_config_the_data_favours(kernels, tmp_path, fast_threads):
    """Measured records (by hand) at three other shapes say one thread count runs fastest; the new shape's
    default takes it, whichever it is, and the source says the model chose it and from how many records."""
    def seconds(cfg):
        return (10e-6 if cfg.threads == fast_threads else 40e-6) * (1 + 0.05 * cfg.rows_per_block)

    (template, name), source, written = _default(kernels, tmp_path, seconds)
    assert template == "rows"
    assert parse_config(name).threads == fast_threads, name
    assert source == f"model ({written} records)"


def test_template_records_counts_the_templates_records_of_other_workloads(kernels, tmp_path):
    db = open_database(tmp_path / "c.db", target=CUDA)
    try:
        n = _write_records(db, kernels["seen"][0], kernels["traces"][0], lambda cfg: 1e-5)
        assert template_records(db, ROWS) == n
        assert template_records(db, ROWS, exclude=db.workload_id(kernels["seen"][0].mod)) == 0
        assert template_records(db, get("wgmma").candidates_key) == 0
    finally:
        db.close()
