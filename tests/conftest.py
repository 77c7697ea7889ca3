"""Shared, expensive fixtures: the example model tuned once (a few trials) into a real SQLite database,
and one artifact built from it. Tests that only read them share them across the session (and, under pytest-xdist,
across its workers: one makes them, the others wait for them)."""
from __future__ import annotations

import json
import os
import shutil
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


def _once(tmp_path_factory, name: str, make):
    """(folder, ``make(folder)``'s JSON result), made once for the whole run. Under pytest-xdist the first worker
    to ask makes it in a folder of the run's that every worker sees, and the others wait for it and read it back
    (each worker tuned and compiled the example again: about 25 s of CPU each); the folder's files are read, or
    copied before they are changed, as a session's are. A make that fails is tried again by the next worker."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.mktemp(name)
        return folder, json.loads(json.dumps(make(folder)))
    import fcntl

    root = tmp_path_factory.getbasetemp().parent / "shared"   # the run's folder, above each worker's own
    root.mkdir(exist_ok=True)
    folder, result = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes, also if make raises
        if not result.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            result.write_text(json.dumps(make(folder)))
        return folder, json.loads(result.read_text())


@pytest.fixture(scope="session")
def tuned_example(tmp_path_factory, example_model):
    """(db path, tune report): every kernel of the example tuned with 2 trials. The search's model is random: XGBoost's
    training after each batch was half of this fixture's time, and no test of it reads the model (the default model
    is tuned with end to end by tests/cli/test_progress.py's --trials run and tests/tune/test_tuner.py's cost model
    tests)."""
    from tvmfuse import api
    from tvmfuse.tune import TuneConfig

    def tune(work):
        cfg = api.ModelConfig(model=example_model, target="llvm", db=work / "tvmfuse.db")
        # no end-to-end check: on a model this small the tuned and untuned builds time within its tolerance, and
        # the build that ships would be a coin toss (tests/compile/test_model_check.py checks it on its own)
        return api.tune(cfg, TuneConfig(trials=14, trials_per_kernel=2, trials_per_round=2, population=16,
                                        cost_model="random", end_to_end_check=False))

    work, report = _once(tmp_path_factory, "tuned", tune)
    return api.ModelConfig(model=example_model, target="llvm", db=work / "tvmfuse.db"), report


@pytest.fixture(scope="session")
def example_artifact(tmp_path_factory, tuned_example):
    from tvmfuse import api

    cfg, _ = tuned_example
    folder, report = _once(tmp_path_factory, "artifact", lambda work: api.compile(cfg, out=work / "example.artifact"))
    return folder / "example.artifact", report


@pytest.fixture(scope="session")
def untuned_example_artifact(tmp_path_factory, example_model):
    """The example compiled without a database (seconds; no tuning). Tests only read it: one that edits an
    artifact edits a copy."""
    from tvmfuse import api

    folder, _ = _once(tmp_path_factory, "untuned", lambda work: api.compile(
        api.ModelConfig(model=example_model, target="llvm"), out=work / "art", untuned=True))
    return folder / "art"


# artifacts are signed with a per-user key (tvmfuse.runtime.signing): the tests' key lives in a folder of their own,
# not the user's configuration (subprocesses inherit it, pytest-xdist's workers too: an artifact one worker made
# verifies in another)
if "TVMFUSE_SIGNING_KEY" not in os.environ and "TVMFUSE_TESTS_CONFIG" not in os.environ:
    os.environ["TVMFUSE_TESTS_CONFIG"] = tempfile.mkdtemp(prefix="tvmfuse-tests-config-")
    os.environ["XDG_CONFIG_HOME"] = os.environ["TVMFUSE_TESTS_CONFIG"]

# the CUDA compile cache (tvmfuse.nvcc_cache): one folder for the whole session, shared by its processes (the tuner's
# workers, the CLI's subprocesses), never the user's; a test of the cache itself uses one of its own
if "TVMFUSE_NVCC_CACHE" not in os.environ:
    os.environ["TVMFUSE_NVCC_CACHE"] = tempfile.mkdtemp(prefix="tvmfuse-tests-nvcc-")

# the checkout's root, for ``benchmarks`` (the long runs whose generators some tests share, e.g. the fuzzer's)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# Under pytest-xdist (`-n auto`) each test goes to whichever worker is free, except these modules': all of a module's
# tests run on one worker, because its module fixture takes many seconds and a fixture is made on each worker that
# runs one of its users (xdist's own `--dist loadgroup` marks do not group under pytest 9: xdist renames the tests'
# node ids, which pytest 9 no longer reads).
ONE_WORKER = {
    "tests/cli/test_progress.py": "three tune runs, about 30 s of CPU",
    "tests/inspect/test_inspect_notebooks.py": "a tuning run and eleven notebook kernels, about 55 s",
    "tests/tune/test_model_default.py": "every row-program config of three shapes scheduled, about 12 s",
    "tests/bench/test_bench.py": "the example benchmarked on every backend, about 11 s",
    "tests/compile/test_cross.py": "the example cross-compiled for aarch64",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":   # another --dist asked for: xdist's own
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = Path(__file__).resolve().parents[1]
    assert all((root / path).is_file() for path in ONE_WORKER), "a module of ONE_WORKER was moved"

    class OneWorkerModules(LoadScopeScheduling):
        """Work units of one test each, or of a whole module of ONE_WORKER (the grouped modules go first:
        xdist orders the units by their tests, most first)."""

        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return path if path in ONE_WORKER else nodeid

    return OneWorkerModules(config, log)


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
