"""The cost model's features (tvmfuse/tune/features.py): configs of one template kernel, which share one placeholder
schedule and so one set of MetaSchedule per-store features, differ in tvmfuse's; the run's XGBoost model reads
them."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest

from tvmfuse._tvm import ms
from tvmfuse.bench.cases import CASES
from tvmfuse.frontend import import_model, load_model
from tvmfuse.plan import partition
from tvmfuse.target import resolve_target
from tvmfuse.tune import extract_kernels
from tvmfuse.tune.defaults import config_schedule
from tvmfuse.tune.features import ANALYTIC, TemplateFeatures, config_features, config_name, width
from tvmfuse.tune.spaces import classify
from tvmfuse.tune.tuner import make_cost_model


@pytest.fixture(scope="module")
def softmax_kernel():
    cuda = resolve_target("cuda")
    path = Path(tempfile.mkdtemp()) / "softmax.onnx"
    onnx.save(CASES["softmax"](M=64, N=2048)[0], path)
    fused, _ = partition(import_model(load_model(path)), target=cuda)
    (k,) = [k for k in extract_kernels(fused, target=cuda) if classify(k.mod["main"]) == "row_reduction"]
    return cuda, k


def _candidates(cuda, kernel, names):
    out = []
    for name in names:
        sch = config_schedule(kernel.mod, cuda.target, "rows", lambda options, name=name: options.index(name))
        assert sch is not None, name
        out.append(ms.MeasureCandidate(sch, ms.arg_info.ArgInfo.from_prim_func(kernel.mod["main"])))
    return out


def test_configs_of_one_template_differ_in_features_where_per_store_features_do_not(softmax_kernel):
    """Three row-program configs of a softmax kernel: MetaSchedule's per-store features are the same for all three
    (the placeholder schedule the builder swaps), tvmfuse's differ, and each config's columns say its knobs."""
    cuda, kernel = softmax_kernel
    names = ["t32 r1", "t64 r2", "t256 r1"]
    cands = _candidates(cuda, kernel, names)
    assert [config_name(c.sch.mod["main"]) for c in cands] == [("rows", n) for n in names]
    ctx = ms.TuneContext(mod=kernel.mod, target=cuda.target, task_name="softmax")
    base = [f.numpy() for f in ms.feature_extractor.PerStoreFeature().extract_from(ctx, cands)]
    assert all(np.array_equal(base[0], b) for b in base[1:])
    ours = [f.numpy() for f in TemplateFeatures().extract_from(ctx, cands)]
    assert all(o.shape == (b.shape[0], b.shape[1] + width()) for o, b in zip(ours, base))
    assert all(np.array_equal(o[:, :b.shape[1]], b) for o, b in zip(ours, base))
    tails = [o[0, base[0].shape[1]:] for o in ours]
    assert len({t.tobytes() for t in tails}) == 3
    t = config_features(cands[1].sch.mod["main"])
    letters = t[width() - 26 - len(ANALYTIC):width() - len(ANALYTIC)]
    assert letters[ord("t") - ord("a")] == pytest.approx(np.log2(65)) and letters[ord("r") - ord("a")] == pytest.approx(np.log2(3))


def test_the_analytic_columns_say_each_configs_launch(softmax_kernel):
    """The columns after the knobs: grid, threads, shared memory, padding, work a block, blocks an SM, waves and
    the last wave's fill, from the row program's figures (the test's softmax: 64 rows of 2048 fp16) on the
    H200's 132 SMs: 64 blocks of one row or 32 of two, none of them a whole wave."""
    from tvmfuse.target import device_figures

    cuda, kernel = softmax_kernel
    cands = _candidates(cuda, kernel, ["t32 r1", "t64 r2", "t256 r1"])
    cols = [dict(zip(ANALYTIC, config_features(c.sch.mod["main"], device_figures(None))[-len(ANALYTIC):]))
            for c in cands]
    assert [2 ** c["blocks"] - 1 for c in cols] == pytest.approx([64, 32, 64])
    assert [2 ** c["threads"] - 1 for c in cols] == pytest.approx([32, 128, 256])
    assert [c["padding"] for c in cols] == [0, 0, 0]
    assert [2 ** c["work"] - 1 for c in cols] == pytest.approx([2048, 4096, 2048])
    assert [c["tail"] for c in cols] == pytest.approx([64 / (132 * 32), 32 / (132 * 16), 64 / (132 * 8)], rel=1e-5)


def test_a_kernel_without_a_template_config_gets_zero_columns(softmax_kernel):
    _, kernel = softmax_kernel
    assert config_name(kernel.mod["main"]) is None
    assert not config_features(kernel.mod["main"]).any()


def test_the_runs_xgboost_model_reads_the_template_features():
    model = make_cost_model("xgb")
    assert isinstance(model.extractor, TemplateFeatures)
