"""benchmarks/search_replay.py: the tuner searching a table of a space's measured times (its ``measure`` runs on
the GPU; the replay, the tuner's own search against the table, runs here)."""
from __future__ import annotations

import json
import math
import random

import pytest

from benchmarks.search_replay import (TableRunner, cold_and_warm, main, replay_arm, summarize, summarize_warm,
                                      template_space)
from benchmarks.bench_convergence import kernel_of


@pytest.fixture(scope="module")
def gemm_table():
    """A real sm_90a wgmma kernel's space (a 512 x 384 x 256 GEMM), its configs given times of a fixed draw (a
    table measure would write), two of them failed."""
    from tvmfuse.kernels import get
    from tvmfuse.target import resolve_target

    target = resolve_target("cuda")
    shape = {"M": 512, "N": 384, "K": 256}
    kernel = kernel_of("gemm", shape, target)
    tname, schedules = template_space(kernel.mod, target.target)
    names = list(schedules)
    rng = random.Random(0)
    configs = {n: {"ms": 0.01 + rng.random() * 0.01, "ok": True, "error": None} for n in names}
    for n in names[1:3]:
        configs[n] = {"ms": None, "ok": False, "error": "run: an error the table kept"}
    default = get(tname).default_config(kernel.mod["main"], target.target).name
    configs[default]["ms"] = 0.03   # slower than every other config: a default the search can beat
    table = {"target": "cuda",
             "shapes": {"gemm:M=512,N=384,K=256": {"class": "gemm", "shape": shape, "template": tname,
                                                   "default": default, "configs": configs}}}
    return target, table


def _second_shape(target, seed: int) -> tuple:
    """(kernel, its space's configs given times of a fixed draw) of a 512 x 384 x 512 GEMM: a shape beside the
    table's."""
    kernel = kernel_of("gemm", {"M": 512, "N": 384, "K": 512}, target)
    _, schedules = template_space(kernel.mod, target.target)
    rng = random.Random(seed)
    return kernel, {n: {"ms": 0.01 + rng.random() * 0.01, "ok": True, "error": None} for n in schedules}


def test_the_space_of_a_wgmma_gemm_lists_its_configs(gemm_table):
    _, table = gemm_table
    (entry,) = table["shapes"].values()
    assert entry["template"] == "wgmma" and len(entry["configs"]) > 8 and entry["default"] in entry["configs"]


def test_the_tuner_searches_the_table_and_never_leaves_it(gemm_table):
    """Both arms run the tuner against the table: the default first (its time the table's), then only configs of
    the table, a failed one recorded as a failure; the search finds a config faster than the default."""
    target, table = gemm_table
    (key, entry), = table["shapes"].items()
    for arm in ("random", "tvmfuse"):
        times = replay_arm(arm, [(key, entry)], target, trials=8, seed=0)[key]
        assert len(times) == 9 and times[0] == pytest.approx(0.03e-3)   # the default, then 8 trials
        table_secs = {c["ms"] / 1e3 for c in entry["configs"].values() if c["ok"]}
        assert all(t in table_secs or math.isinf(t) or t > 1e3 for t in times), times
        assert min(times) < times[0]


def test_candidates_that_fail_to_build_teach_the_shared_model(gemm_table, tmp_path):
    """MetaSchedule's cost-model update skips a candidate whose build failed; the tuner hands those to its model as
    failures, so every trial of the search (the default aside) is a sample the model learnt from."""
    from benchmarks.search_replay import TableBuilder
    from tvmfuse.db import open_database
    from tvmfuse.tune import tune_kernels
    from tvmfuse.tune.cost_model import make_cost_model
    from tvmfuse.tune.tuner import TuneConfig

    target, table = gemm_table
    (key, entry), = table["shapes"].items()
    kept = dict(list(entry["configs"].items())[::4])   # the rest fail to build: not configs of this table
    kept[entry["default"]] = entry["configs"][entry["default"]]
    names: dict = {}
    model = make_cost_model("xgb")
    config = TuneConfig(trials=16, trials_per_kernel=17, trials_per_round=8, population=64, seed=0, cost_model="xgb",
                        check=False, retime_finalists=0, strategy="evolutionary", nvcc_cache="off")
    kernel = kernel_of("gemm", entry["shape"], target)
    (result,) = tune_kernels([kernel], target=target, database=open_database(tmp_path / "r.db", target=target),
                             config=config, cost_model=model, builder=TableBuilder(kept, names),
                             runner=TableRunner(kept, names))
    assert result.status in ("tuned", "exhausted")
    import sqlite3

    with sqlite3.connect(tmp_path / "r.db") as db:
        failed = db.execute("select count(*) from trial_errors").fetchone()[0]
    # (trials_run counts the default too, which is measured outside the search)
    assert failed > 0 and model.data_size == result.trials_run - 1 == 16, (model.data_size, result.trials_run, failed)


def test_a_default_the_model_chose_is_measured_beside_the_rule(gemm_table, tmp_path):
    """Once the shared model has learnt the template at one shape, it picks the next shape's first config; the
    hand rule (what an untuned build runs) is measured too, so a tuned build is never slower than the untuned
    one because the model's pick was worse."""
    from benchmarks.search_replay import TableBuilder
    from tvmfuse.db import open_database
    from tvmfuse.kernels import get
    from tvmfuse.tune import tune_kernels
    from tvmfuse.tune.cost_model import make_cost_model
    from tvmfuse.tune.tuner import TuneConfig

    target, table = gemm_table
    (key, entry), = table["shapes"].items()
    second, configs = _second_shape(target, 1)
    rule = get("wgmma").default_config(second.mod["main"], target.target).name
    model, db = make_cost_model("xgb"), open_database(tmp_path / "m.db", target=target)
    config = TuneConfig(trials=16, trials_per_kernel=17, trials_per_round=8, population=64, seed=0, cost_model="xgb",
                        check=False, retime_finalists=0, strategy="evolutionary", nvcc_cache="off")
    results, asked = [], []
    for kernel, configs_of in ((kernel_of("gemm", entry["shape"], target), entry["configs"]), (second, configs)):
        names: dict = {}
        runner = TableRunner(configs_of, names)
        (r,) = tune_kernels([kernel], target=target, database=db, config=config, cost_model=model,
                            builder=TableBuilder(configs_of, names), runner=runner)
        results.append(r)
        asked.append(runner.asked)
    assert results[0].default == "rule"
    assert results[1].default.startswith("model ("), results[1].default
    assert rule in asked[1][:2] and results[1].baseline_s == pytest.approx(configs[rule]["ms"] / 1e3)
    if results[1].default.endswith("= rule"):   # the model picked the rule's config: measured once
        assert asked[1][1] != rule
    else:
        assert results[1].default.endswith(" + rule"), results[1].default


def test_the_search_measures_no_config_the_database_holds(gemm_table, tmp_path):
    """MetaSchedule's evolutionary search excludes only what it measured itself; tvmfuse's wraps it so that a config
    the database already holds is answered from its record, not measured. A second shape's warm run (the model's
    pick measured first, then the rule) never measures the pick again, which its search proposed first without the
    wrapper; a resumed run measures only configs the first did not, as many as it was given."""
    from benchmarks.search_replay import TableBuilder
    from tvmfuse.db import open_database
    from tvmfuse.tune import tune_kernels
    from tvmfuse.tune.cost_model import make_cost_model
    from tvmfuse.tune.tuner import TuneConfig

    target, table = gemm_table
    (key, entry), = table["shapes"].items()
    second, configs = _second_shape(target, 1)
    db, model = open_database(tmp_path / "r.db", target=target), make_cost_model("xgb")
    asked, results = [], []
    for kernel, table_of, per_kernel in ((kernel_of("gemm", entry["shape"], target), entry["configs"], 17),
                                         (second, configs, 17), (second, configs, 29)):
        config = TuneConfig(trials=16, trials_per_kernel=per_kernel, trials_per_round=8, population=64, seed=0,
                            cost_model="xgb", check=False, retime_finalists=0, strategy="evolutionary",
                            nvcc_cache="off")
        names: dict = {}
        runner = TableRunner(table_of, names)
        (r,) = tune_kernels([kernel], target=target, database=db, config=config, cost_model=model,
                            builder=TableBuilder(table_of, names), runner=runner)
        asked.append(runner.asked)
        results.append(r)
    assert results[1].default.startswith("model (") and not results[1].default.endswith("= rule")
    assert all(len(set(a)) == len(a) for a in asked), [len(a) - len(set(a)) for a in asked]
    assert len(asked[1]) == 18   # the model's pick, the rule, 16 trials
    assert asked[2] and not set(asked[2]) & set(asked[1]) and len(asked[2]) <= 12   # the kernel's 29 less 17


def test_the_runner_answers_from_the_table():
    from tvmfuse._tvm import ms

    runner = TableRunner({"a b": {"ms": 2.0, "ok": True, "error": None},
                          "c d": {"ms": None, "ok": False, "error": "check: 1e-1"}}, {"/x/1": "a b", "/x/2": "c d"})
    inputs = [ms.runner.RunnerInput("/x/1", "cuda", []), ms.runner.RunnerInput("/x/2", "cuda", [])]
    ok, bad = (f.result() for f in runner.run(inputs))
    assert [float(s) for s in ok.run_secs] == [0.002] and ok.error_msg is None
    assert bad.run_secs is None and "check" in bad.error_msg and runner.asked == ["a b", "c d"]


def test_dlights_schedule_is_the_tables_stock_default_and_only_the_first_candidate_maps_to_it():
    """A ragged LayerNorm whose untuned build runs dlight's rules: the tuner measures that schedule first, and the
    table answers it as STOCK; a later candidate that selects no config (another sketch's) is outside the table."""
    from benchmarks.search_replay import STOCK, TableBuilder
    from tvmfuse._gpu_rules import default_schedule
    from tvmfuse._tvm import ms
    from tvmfuse.target import resolve_target

    target = resolve_target("cuda")
    kernel = kernel_of("rows", {"case": "layernorm", "M": 32, "N": 848}, target)
    stock = default_schedule(kernel.mod, target.target, is_gpu=True)
    names: dict = {}
    builder = TableBuilder({STOCK: {"ms": 1.0, "ok": True, "error": None}}, names)
    first, second = builder.build([ms.builder.BuilderInput(stock.mod, target.target)] * 2)
    assert first.error_msg is None and list(names.values()) == [STOCK]
    assert second.artifact_path is None and "not a config of the table" in second.error_msg


def test_the_summary_counts_the_shapes_whose_default_leaves_room(gemm_table):
    _, table = gemm_table
    (key,) = table["shapes"]
    best = min(c["ms"] for c in table["shapes"][key]["configs"].values() if c["ok"])
    runs = {0: {"random": {key: [0.03e-3, 0.02e-3] + [0.015e-3] * 32},
                "tvmfuse": {key: [0.03e-3, 0.016e-3, best / 1e3]}}}
    (row,) = summarize(table, runs, 32)
    assert row["default_below_95pct"] == 1 and row["default_over_space_best"] == pytest.approx(0.03 / best)
    assert row["trials_to_random32"] == 2 and row["default_over_tuned"] == pytest.approx(0.03 / best)


def test_warm_tunes_each_shape_cold_and_from_the_other_shapes_records(gemm_table, tmp_path):
    """``warm``: each shape alone in a fresh database, then again in a database merged from the other shapes' cold
    runs, the model warm-started from it: the second shape's warm run starts from the first's records (its default
    then the model's pick beside the rule), and both stay inside the table."""
    target, table = gemm_table
    (key, entry), = table["shapes"].items()
    _, configs = _second_shape(target, 2)
    other = {"class": "gemm", "shape": {"M": 512, "N": 384, "K": 512}, "template": "wgmma", "default": None,
             "configs": configs}
    runs = cold_and_warm([(key, entry), ("gemm:M=512,N=384,K=512", other)], target, trials=8, seed=0, work=tmp_path)
    assert set(runs) == {"cold", "warm"} and all(len(r) == 2 for r in runs.values())
    assert all(len(t) >= 9 for r in runs.values() for t in r.values())
    assert runs["cold"][key][0] == pytest.approx(0.03e-3)   # the rule first, cold
    from tvmfuse.db import open_database

    warm_db = open_database(tmp_path / "warm1.db", target=target)
    assert len(warm_db.list_workloads()) == 2   # the first shape's cold records, then the second's own
    warm_db.close()


def test_the_warm_summary_counts_trials_to_ninety_percent_of_the_cold_final(gemm_table):
    _, table = gemm_table
    (key,) = table["shapes"]
    best = min(c["ms"] for c in table["shapes"][key]["configs"].values() if c["ok"]) / 1e3
    runs = {0: {"cold": {key: [0.03e-3, 0.02e-3, 0.02e-3, 0.02e-3, best]},
                "warm": {key: [0.03e-3, best / 0.95]}},
            1: {"cold": {key: [0.03e-3, best]}, "warm": {key: [0.03e-3, 0.02e-3, best]}}}
    (row,) = summarize_warm(table, runs, 32)
    assert row["runs"] == 2 and row["cold_trials"] == 2.5 and row["warm_trials"] == 1.5
    assert row["warm_over_cold"] == pytest.approx((0.25 + 2.0) / 2) and row["warm_within_quarter"] == 1
    assert row["warm_final_over_cold"] == pytest.approx((1 / 0.95 + 1.0) / 2)


def test_a_missing_table_or_gpu_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["replay", "--table", str(tmp_path / "none.json")]) == 2
    assert "no table" in capsys.readouterr().err
    assert main(["warm", "--table", str(tmp_path / "none.json")]) == 2
    assert "no table" in capsys.readouterr().err
    from tvmfuse.target import resolve_target

    if not resolve_target("cuda").runs_here():
        assert main(["measure", "--table", str(tmp_path / "t.json")]) == 2
        assert "needs the GPU" in capsys.readouterr().err and not (tmp_path / "t.json").exists()
