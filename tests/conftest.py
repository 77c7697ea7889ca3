"""Shared, expensive fixtures: the example model tuned once (a few trials) into a real SQLite database,
and one artifact built from it. Tests that only read them share them across the session."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "tvmfuse" / "data" / "example.onnx"


@pytest.fixture(scope="session")
def example_model() -> Path:
    return EXAMPLE


@pytest.fixture(scope="session")
def llvm_target():
    from tvmfuse.target import resolve_target

    return resolve_target("llvm")


@pytest.fixture(scope="session")
def tuned_example(tmp_path_factory, example_model):
    """(db path, tune report): every kernel of the example tuned with 2 trials. The search's model is random: XGBoost's
    training after each batch was half of this fixture's time, and no test of it reads the model (the default model
    is tuned with end to end by tests/cli/test_progress.py's --trials run and tests/tune/test_tuner.py's cost model
    tests)."""
    from tvmfuse import api
    from tvmfuse.tune import TuneConfig

    work = tmp_path_factory.mktemp("tuned")
    cfg = api.ModelConfig(model=example_model, target="llvm", db=work / "tvmfuse.db")
    report = api.tune(cfg, TuneConfig(trials=14, trials_per_kernel=2, trials_per_round=2, population=16,
                                      cost_model="random"))
    return cfg, report


@pytest.fixture(scope="session")
def example_artifact(tmp_path_factory, tuned_example):
    from tvmfuse import api

    cfg, _ = tuned_example
    out = tmp_path_factory.mktemp("artifact") / "example.artifact"
    report = api.compile(cfg, out=out)
    return out, report


@pytest.fixture(scope="session")
def untuned_example_artifact(tmp_path_factory, example_model):
    """The example compiled without a database (seconds; no tuning). Tests only read it: one that edits an
    artifact edits a copy."""
    from tvmfuse import api

    out = tmp_path_factory.mktemp("untuned") / "art"
    api.compile(api.ModelConfig(model=example_model, target="llvm"), out=out, untuned=True)
    return out


# artifacts are signed with a per-user key (tvmfuse.runtime.signing): the tests' key lives in a folder of their own,
# not the user's configuration (subprocesses inherit it)
if "TVMFUSE_SIGNING_KEY" not in os.environ:
    os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="tvmfuse-tests-config-")

# the CUDA compile cache (tvmfuse.nvcc_cache): one folder for the whole session, shared by its processes (the tuner's
# workers, the CLI's subprocesses), never the user's; a test of the cache itself uses one of its own
if "TVMFUSE_NVCC_CACHE" not in os.environ:
    os.environ["TVMFUSE_NVCC_CACHE"] = tempfile.mkdtemp(prefix="tvmfuse-tests-nvcc-")

# the checkout's root, for ``benchmarks`` (the long runs whose generators some tests share, e.g. the fuzzer's)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pytest_configure(config):
    # MetaSchedule's builder workers import tvmfuse (our build function): make the checkout importable; and every
    # process the tests start imports TVM without PyTorch (tests/_site/sitecustomize.py says why), this one too
    root = str(Path(__file__).resolve().parents[1])
    site = str(Path(__file__).resolve().parent / "_site")
    os.environ["PYTHONPATH"] = os.pathsep.join([site, root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                               else []))
    import importlib.util

    spec = importlib.util.spec_from_file_location("_tvmfuse_tests_site", os.path.join(site, "sitecustomize.py"))
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
