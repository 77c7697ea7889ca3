import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import make_mod, target  # noqa: E402


@pytest.fixture(scope="session")
def tuned_db(tmp_path_factory):
    """A database holding a real (tiny) MetaSchedule tuning run of the 64x64 add, llvm num-cores 1."""
    from tune_child import tune

    from tvmfuse.db import open_database

    d = tmp_path_factory.mktemp("tuned")
    db = open_database(d / "tuned.db", target=target())
    mod = make_mod(64)
    db.set_task_name(mod, "add64", model="tiny")
    tune(db, mod, str(d / "work"), 4)
    db.close()
    return d / "tuned.db"


@pytest.fixture
def tuned_copy(tuned_db, tmp_path):
    """A private copy of the tuned database (the session one stays pristine)."""
    dest = tmp_path / "copy.db"
    shutil.copyfile(tuned_db, dest)
    return dest
