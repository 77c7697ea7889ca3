"""`run --profile`: each kernel of the artifact's own run timed through the Relax VM's instrument hook, joined with
the manifest, and a Chrome trace of the calls. The session's tuned example artifact, real TVM."""
from __future__ import annotations

import json

import pytest

from tvmfuse import api, verify
from tvmfuse.runtime import load_artifact
from tvmfuse.runtime.profile import NOTE

pytestmark = pytest.mark.slow


def test_profile_times_every_kernel_of_the_manifest_and_writes_a_trace(example_artifact, tmp_path):
    path, _ = example_artifact
    manifest = json.loads((path / "manifest.json").read_text())
    trace = tmp_path / "trace.json"
    report = api.run(path, repeat=0, warmup=2, profile=True, profile_runs=3, trace=trace)
    prof = report["profile"]
    assert prof["runs"] == 3 and prof["warmup"] == 2 and prof["note"] == NOTE and prof["trace"] == str(trace)
    rows = {k["name"]: k for k in prof["kernels"]}
    for k in manifest["kernels"]:  # each kernel of the manifest ran, once a run, its schedule joined in
        row = rows[k["name"]]
        assert row["seen"] and row["calls"] == 1, row
        assert row["schedule"] == k["schedule"] == "tuned" and row["tuned_ms"] == k["best_ms"]
        assert row["total_ms"] > 0 and row["mean_ms"] == pytest.approx(row["total_ms"])
    assert prof["kernels_ms"] == pytest.approx(sum(k["total_ms"] for k in prof["kernels"]))
    assert 0 < prof["kernels_ms"] < prof["run_ms"]  # the rest of a run is the VM's builtins
    assert sum(k["share"] for k in prof["kernels"]) == pytest.approx(1.0)
    assert [k["total_ms"] for k in prof["kernels"]] == sorted((k["total_ms"] for k in prof["kernels"]), reverse=True)
    assert not any(k["name"].startswith("vm.builtin") for k in prof["kernels"])

    events = json.loads(trace.read_text())["traceEvents"]
    timed = [e for e in events if e["ph"] == "X"]
    assert all({"name", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e) for e in timed)
    assert [e["ts"] for e in timed] == sorted(e["ts"] for e in timed)  # ordered in time
    runs = [e for e in timed if e["cat"] == "run"]
    calls = [e for e in timed if e["cat"] == "kernel"]
    assert len(runs) == 3 and len(calls) == 3 * len(manifest["kernels"])
    for c in calls:  # each call lies inside its run, and the calls do not overlap
        run = runs[c["args"]["run"] - 1]
        assert run["ts"] <= c["ts"] and c["ts"] + c["dur"] <= run["ts"] + run["dur"] + 1e-3
        assert c["dur"] > 0 and c["args"]["schedule"] == "tuned"
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(calls, calls[1:]))


def test_profiling_leaves_the_model_as_it_was(example_artifact):
    """The instrument is removed afterwards: outputs are unchanged and later runs are not timed by it."""
    art = load_artifact(example_artifact[0])
    feeds = verify.random_inputs(art.input_specs, seed=1)
    (before,) = art.run(feeds)
    prof = art.profile(feeds, runs=2, warmup=0)
    assert len(prof.calls) == 2 * len(art.manifest["kernels"])
    (after,) = art.run(feeds)
    assert (before == after).all()
    assert len(prof.calls) == 2 * len(art.manifest["kernels"])
