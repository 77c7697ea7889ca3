"""The end-to-end check (tvmfuse/compile/model_check.py): tune times the whole model's tuned build against its
untuned one and keeps the times; compile and bench ship the untuned build where the tuned one was slower, as long as
no record came after the check."""
from __future__ import annotations

import shutil

import pytest

from tvmfuse import api
from tvmfuse.compile.model_check import TOLERANCE, build_checked, check_model, model_key
from tvmfuse.db import open_database
from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition
from tvmfuse.tune import TuneConfig


@pytest.fixture
def tuned_copy(tuned_example, tmp_path, llvm_target):
    """(ModelConfig on a copy of the tuned example's database, the partitioned model)."""
    cfg, _ = tuned_example
    db = tmp_path / "tvmfuse.db"
    shutil.copy(cfg.db, db)
    fused, _ = partition(import_model(load_model(cfg.model)), target=llvm_target)
    return api.ModelConfig(model=cfg.model, target="llvm", db=db), fused


def test_the_check_times_both_builds_and_keeps_them_in_the_database(tuned_copy, llvm_target):
    cfg, fused = tuned_copy
    db = open_database(cfg.db, target=llvm_target)
    try:
        assert db.model_check(model_key(fused)) is None
        report = check_model(fused, target=llvm_target, database=db, rounds=3)
        kept = db.model_check(model_key(fused))
    finally:
        db.close()
    assert report["tuned_ms"] > 0 and report["untuned_ms"] > 0 and report["rounds"] == 3
    assert kept["current"] and kept["tuned_ms"] == pytest.approx(report["tuned_ms"], abs=1e-4)
    assert report["ships"] == ("untuned" if kept["tuned_ms"] > kept["untuned_ms"] * (1 + TOLERANCE) else "tuned")


def test_compile_ships_the_untuned_build_where_the_tuned_one_was_slower_until_new_records(tuned_copy, llvm_target,
                                                                                         tmp_path):
    cfg, fused = tuned_copy
    db = open_database(cfg.db, target=llvm_target)
    try:
        db.record_model_check(model_key(fused), tuned_ms=1.10, untuned_ms=1.00)   # the tuned build 10% slower
    finally:
        db.close()
    report = api.compile(cfg, out=tmp_path / "a.artifact")
    assert report["end_to_end_check"] == {"tuned_ms": 1.1, "untuned_ms": 1.0, "current": True, "ships": "untuned"}
    assert {k["schedule"] for k in report["kernels"]} == {"cpu-default"}
    assert len(report["untuned"]) == len(report["kernels"])

    # within the tolerance the records ship
    db = open_database(cfg.db, target=llvm_target)
    try:
        db.record_model_check(model_key(fused), tuned_ms=1.01, untuned_ms=1.00)
        built, check = build_checked(fused, target=llvm_target, database=db)
    finally:
        db.close()
    assert check["ships"] == "tuned" and not built.untuned

    # a record newer than the check outdates it: the records ship, and the report says the check is not current
    db = open_database(cfg.db, target=llvm_target)
    try:
        db.record_model_check(model_key(fused), tuned_ms=1.10, untuned_ms=1.00)
        row = db.best_record(db.list_workloads()[0].workload_id)
        db.retime_records([row.id], [float(row.mean_secs)])   # retiming changes no id: still current
        assert db.model_check(model_key(fused))["current"]
    finally:
        db.close()
    report = api.tune(cfg, TuneConfig(trials=2, trials_per_kernel=2, trials_per_round=1, population=16, retune=True,
                                      cost_model="random", end_to_end_check=False))
    assert report["trials_run"] > 0
    db = open_database(cfg.db, target=llvm_target)
    try:
        built, check = build_checked(fused, target=llvm_target, database=db)
    finally:
        db.close()
    assert check == {"tuned_ms": 1.1, "untuned_ms": 1.0, "current": False, "ships": "tuned"}
    assert len(built.untuned) < len(built.kernels)


def test_the_key_names_the_kernels_not_the_file(tuned_copy, llvm_target, tmp_path):
    cfg, fused = tuned_copy
    again, _ = partition(import_model(load_model(cfg.model)), target=llvm_target)
    assert model_key(again) == model_key(fused)
    other = tmp_path / "copy.onnx"
    shutil.copy(cfg.model, other)
    assert model_key(partition(import_model(load_model(other)), target=llvm_target)[0]) == model_key(fused)


@pytest.mark.slow
def test_tune_on_the_cli_ends_with_the_check_and_names_the_build_that_ships(tuned_copy, llvm_target):
    import json

    from typer.testing import CliRunner

    from tvmfuse.cli.main import app

    cfg, fused = tuned_copy
    result = CliRunner().invoke(app, ["tune", str(cfg.model), "--target", "llvm", "--db", str(cfg.db), "--trials", "2",
                                      "--trials-per-kernel", "2", "--retune", "--cost-model", "random", "--json"])
    assert result.exit_code == 0, result.output
    e2e = json.loads(result.stdout)["end_to_end"]
    assert e2e["rounds"] == 15 and e2e["tuned_ms"] > 0 and e2e["untuned_ms"] > 0 and e2e["ships"] in ("tuned", "untuned")
    db = open_database(cfg.db, target=llvm_target)
    try:
        assert db.model_check(model_key(fused))["current"]
    finally:
        db.close()
