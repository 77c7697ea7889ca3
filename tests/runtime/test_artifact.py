import shutil

import numpy as np
import pytest

from tvmfuse import api, verify
from tvmfuse.errors import ArtifactError, VerificationError
from tvmfuse.runtime import load_artifact

pytestmark = pytest.mark.slow


def test_artifact_round_trip_matches_onnxruntime(example_artifact, example_model):
    path, _ = example_artifact
    art = load_artifact(path)
    feeds = verify.random_inputs(art.input_specs, seed=3)
    (out,) = art.run(feeds)
    (ref,) = verify.run_onnxruntime(example_model, feeds)
    assert out.shape == ref.shape == (1, 64, 32)
    assert verify.relative_error(out, ref) < 1e-4


def test_run_reports_latency_and_verification(example_artifact, example_model, tmp_path):
    path, _ = example_artifact
    np.savez(tmp_path / "in.npz", x=np.ones((1, 8, 16, 16), np.float32))
    report = api.run(path, inputs=tmp_path / "in.npz", verify_against=example_model, repeat=5)
    assert report["verification"]["ok"]
    assert report["verification"]["outputs"][0]["rel_error"] < 1e-4
    lat = report["latency_ms"]
    assert 0 < lat["min"] <= lat["median"] <= lat["p90"]


def test_tampered_library_is_refused_before_loading(example_artifact, tmp_path):
    path, _ = example_artifact
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    with open(copy / "model.so", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactError, match="sha256"):
        load_artifact(copy)


def test_wrong_input_shape_is_a_clear_error(example_artifact):
    art = load_artifact(example_artifact[0])
    with pytest.raises(ArtifactError, match="input 'x'"):
        art.run({"x": np.zeros((1, 8, 8, 8), np.float32)})


def test_verification_failure_is_reported(example_artifact, tmp_path):
    """An artifact checked against a different model must fail verification, not pass silently."""
    import onnx

    model = onnx.load(api.EXAMPLE_MODEL)
    for init in model.graph.initializer:
        if init.name == "b4":
            arr = onnx.numpy_helper.to_array(init) + 1.0
            init.CopyFrom(onnx.numpy_helper.from_array(arr, "b4"))
    other = tmp_path / "other.onnx"
    onnx.save(model, other)
    with pytest.raises(VerificationError, match="relative error"):
        api.run(example_artifact[0], verify_against=other, repeat=0)


def test_benchmark_runs_at_least_repeat_times_and_min_seconds(example_artifact):
    import time

    path, _ = example_artifact
    art = load_artifact(path)
    feeds = verify.random_inputs(art.input_specs, seed=0)
    assert len(art.benchmark(feeds, repeat=3, warmup=0)) == 3
    t0 = time.perf_counter()
    times = art.benchmark(feeds, repeat=2, warmup=1, min_seconds=0.25)
    assert time.perf_counter() - t0 >= 0.25
    assert len(times) > 2 and sum(times) <= time.perf_counter() - t0  # a run of the example is far below 0.25 s


def test_run_saves_the_outputs_it_verified(example_artifact, example_model, tmp_path):
    path, _ = example_artifact
    report = api.run(path, verify_against=example_model, outputs=tmp_path / "o.npz", repeat=0)
    with np.load(tmp_path / "o.npz") as npz:
        saved = {k: npz[k] for k in npz.files}
    assert list(saved) == [o["name"] for o in report["outputs"]]
    again = api.run(path, compare_to=tmp_path / "o.npz", repeat=0)
    assert again["verification"]["ok"] and again["verification"]["outputs"][0]["rel_error"] == 0.0
