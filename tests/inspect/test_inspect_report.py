"""inspect_database on a freshly tuned database (the session's ``tuned_example``: 2 trials per kernel)."""
from __future__ import annotations

import shutil

import pytest

from tvmfuse.errors import DatabaseError, TvmfuseError
from tvmfuse.inspect import InspectConfig, curves_frame, inspect_database, kernels_frame


@pytest.fixture(scope="module")
def with_model(tuned_example):
    cfg, _ = tuned_example
    return inspect_database(InspectConfig(db=cfg.db, model=str(cfg.model)))


@pytest.fixture(scope="module")
def plan(tuned_example):
    from tvmfuse.frontend import import_model, load_model
    from tvmfuse.plan import partition
    from tvmfuse.target import resolve_target

    cfg, _ = tuned_example
    return partition(import_model(load_model(cfg.model)), target=resolve_target("llvm"))[1]


def test_every_tuned_kernel_is_reported(with_model, tuned_example):
    _, tune = tuned_example
    tuned = {k["name"]: k for k in tune["kernels"]}
    got = {k["name"]: k for k in with_model["kernels"]}
    assert set(got) == set(tuned)
    for name, k in got.items():
        assert k["trials"] == tuned[name]["trials_before"] + tuned[name]["trials_run"]
        assert k["trials"] == len(k["trial_ms"])
        assert k["best_ms"] == pytest.approx(tuned[name]["best_ms"])
        assert k["best_ms"] <= k["first_ms"] and k["speedup"] >= 1.0
        assert k["calls"] >= 1 and k["calls_source"] == "model"
    assert with_model["summary"]["trials"] == sum(k["trials"] for k in got.values())


def test_pattern_and_bytes_come_from_the_plan(with_model, plan):
    groups = {g.kernel or g.name: g for g in plan.groups}
    for k in with_model["kernels"]:
        g = groups[k["name"]]
        assert k["pattern_source"] == "plan" and k["pattern"] == g.pattern and k["ops"] == list(g.ops)
        # the planner's fused bytes and inspect's IR bytes are two derivations of one figure
        assert k["hbm_bytes"] == k["bytes_fused"] == g.bytes_fused
        assert k["hbm_bytes"] == sum(b["bytes"] for b in k["inputs"] + k["outputs"])
        assert k["achieved_gbs"] == pytest.approx(k["hbm_bytes"] / (k["best_ms"] * 1e-3) / 1e9)
        assert k["bandwidth_share"] == pytest.approx(k["achieved_gbs"] / with_model["ceilings"]["bandwidth_gbs"])
    assert with_model["model"]["plan"]["bytes_fused"] == plan.totals["bytes_fused"]


def test_shapes_of_the_conv_kernel(with_model):
    conv = next(k for k in with_model["kernels"] if k["pattern"] == "conv_epilogue")
    # CPU plans run convs channels-last: the NHWC activation and the HWIO filter
    assert conv["inputs"][0]["shape"] == [1, 16, 16, 8] and conv["inputs"][0]["dtype"] == "float32"
    assert conv["inputs"][1]["shape"] == [3, 3, 8, 32]
    assert [o["shape"] for o in conv["outputs"]] == [[1, 64, 32]]
    assert conv["flops"] and conv["flops_per_byte"] > 1


def test_name_patterns_agree_with_the_planner_on_the_example(tuned_example, with_model):
    cfg, _ = tuned_example
    bare = inspect_database(InspectConfig(db=cfg.db))
    assert {k["name"]: k["pattern"] for k in bare["kernels"]} == {k["name"]: k["pattern"] for k in with_model["kernels"]}
    assert all(k["pattern_source"] == "name" and k["calls_source"] == "assumed" for k in bare["kernels"])
    assert any("unknown without the ONNX model" in w for w in bare["model"]["why"])


def test_model_sum_against_a_given_end_to_end(tuned_example):
    cfg, _ = tuned_example
    r = inspect_database(InspectConfig(db=cfg.db, model=str(cfg.model), e2e_ms=50.0))
    m = r["model"]
    assert m["kernel_sum_ms"] == pytest.approx(sum(k["best_ms"] * k["calls"] for k in r["kernels"]))
    assert m["gap_ms"] == pytest.approx(50.0 - m["kernel_sum_ms"])
    assert any("launch and VM overhead" in w for w in m["why"])


def test_model_label_and_kernel_filter(tuned_example):
    cfg, _ = tuned_example
    r = inspect_database(InspectConfig(db=cfg.db, model="example", kernel="layer_norm"))
    assert [k["name"] for k in r["kernels"]] == ["layer_norm"]
    with pytest.raises(TvmfuseError, match="no kernel matches"):
        inspect_database(InspectConfig(db=cfg.db, kernel="no-such-kernel"))
    with pytest.raises(TvmfuseError, match="models in the database: example"):
        inspect_database(InspectConfig(db=cfg.db, model="resnet"))


def test_other_target_and_missing_file(tuned_example, tmp_path):
    cfg, _ = tuned_example
    with pytest.raises(DatabaseError, match="no records for target"):
        inspect_database(InspectConfig(db=cfg.db, target="cuda"))
    with pytest.raises(DatabaseError, match="does not exist"):
        inspect_database(InspectConfig(db=tmp_path / "none.db"))


def test_failed_trials_are_counted_with_their_kind(tuned_example, tmp_path):
    """A failed record committed through the database's own MetaSchedule interface shows up as an error."""
    from tvmfuse._tvm import ms
    from tvmfuse.db import open_database
    from tvmfuse.target import resolve_target

    cfg, _ = tuned_example
    db_path = tmp_path / "copy.db"
    shutil.copy(cfg.db, db_path)
    db = open_database(db_path, target=resolve_target("llvm"), create=False)
    try:
        rec = db.get_all_tuning_records()[0]
        db.commit_tuning_record(ms.database.TuningRecord(rec.trace, rec.workload, run_secs=[1e10],
                                                         target=rec.target, args_info=rec.args_info))
        wid = db.workload_id(rec.workload.mod)
    finally:
        db.close()
    r = inspect_database(InspectConfig(db=db_path))
    k = next(k for k in r["kernels"] if k["workload_id"] == wid)
    assert k["failed"] == 1 and k["trial_ms"][-1] is None
    assert k["errors"] == {"no message kept (rejected by the check, or tuned before messages were kept)": 1}
    assert r["summary"]["failed"] == 1


def test_frames(with_model):
    kf = kernels_frame(with_model)
    assert len(kf) == len(with_model["kernels"]) and (kf["best_us"] <= kf["first_us"]).all()
    cf = curves_frame(with_model)
    assert len(cf) == sum(k["trials"] for k in with_model["kernels"])
    last = cf.groupby("name")["best_us"].last()
    assert last.to_dict() == pytest.approx(kf.set_index("name")["best_us"].to_dict())
    # best so far never rises
    assert all((g["best_us"].diff().fillna(0) <= 0).all() for _, g in cf.groupby("name"))


def test_end_to_end_from_the_artifact(tuned_example, example_artifact):
    cfg, _ = tuned_example
    art, _ = example_artifact
    r = inspect_database(InspectConfig(db=cfg.db, model=str(cfg.model), artifact=art, repeat=5))
    m = r["model"]
    assert m["e2e_ms"] > 0 and "median of 5 runs" in m["source"]
    assert m["artifact_kernels"] == len(r["kernels"])
    assert m["kernel_share"] == pytest.approx(m["kernel_sum_ms"] / m["e2e_ms"])
    assert m["why"]


def test_records_of_another_device_are_read_with_their_own_identity(tuned_example, tmp_path):
    """A database tuned elsewhere: inspect binds to the (target, device) the file holds, and has no ceiling for it."""
    import sqlite3

    cfg, _ = tuned_example
    db_path = tmp_path / "elsewhere.db"
    shutil.copy(cfg.db, db_path)
    con = sqlite3.connect(db_path)
    with con:
        for table in ("records", "workload_targets"):
            con.execute(f"UPDATE {table} SET device='cpu:Some Other CPU x2'")
    r = inspect_database(InspectConfig(db=db_path))
    assert r["device"] == "cpu:Some Other CPU x2" and r["summary"]["trials"] > 0
    assert r["ceilings"]["bandwidth_gbs"] is None and all(k["bandwidth_share"] is None for k in r["kernels"])
    r = inspect_database(InspectConfig(db=db_path, bandwidth_gbs=10.0))
    assert all(k["bandwidth_share"] == pytest.approx(k["achieved_gbs"] / 10.0) for k in r["kernels"])
    with con:  # a second device in the same file: the caller must choose
        con.execute("INSERT INTO workload_targets(workload_id, target, device, task_name, model, created) "
                    "SELECT workload_id, target, 'cpu:Third CPU x2', task_name, model, created FROM workload_targets")
    con.close()
    with pytest.raises(DatabaseError, match="several targets"):
        inspect_database(InspectConfig(db=db_path))
