"""Records are keyed by the search space file and the template's code: a change to either gives another key, and a
handle under the new key never serves a record made under the old one (it is still in the file, for inspection)."""
import shutil
import sqlite3

import pytest
from helpers import make_mod, make_record, target

from tvmfuse.db import open_database
from tvmfuse.target import H200_CUDA
from tvmfuse.kernels import code_digest, get
from tvmfuse.tune.spaces import SPACES_DIR, load_space_file, space_key


def _space_dirs(tmp_path):
    """The package's space files, and a copy whose files differ by one comment."""
    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(SPACES_DIR, same)
    shutil.copytree(SPACES_DIR, other)
    for f in other.glob("*.yaml"):
        f.write_text(f.read_text() + "# one more comment\n")
    return same, other


def test_the_space_files_contents_change_the_key(tmp_path):
    same, other = _space_dirs(tmp_path)
    mod = make_mod(16)
    for kind in ("llvm", "cuda"):
        key = space_key(mod, load_space_file(SPACES_DIR / f"{kind}.yaml"))
        assert space_key(mod, load_space_file(same / f"{kind}.yaml")) == key   # the contents, not the path
        assert space_key(mod, load_space_file(other / f"{kind}.yaml")) != key


def test_the_templates_code_changes_the_key(tmp_path, monkeypatch):
    """A pointwise kernel on CUDA is tuned with the pointwise template: its code keys the records; on llvm every
    class is MetaSchedule's stock space, which no template's code keys."""
    mod = make_mod(16)
    cuda, llvm = load_space_file(SPACES_DIR / "cuda.yaml"), load_space_file(SPACES_DIR / "llvm.yaml")
    before, before_llvm = space_key(mod, cuda), space_key(mod, llvm)
    code = tmp_path / "template.py"
    code.write_text("x = 1\n")
    pointwise = type(get("pointwise"))
    monkeypatch.setattr(pointwise, "source_files", lambda self: [code])
    first = space_key(mod, cuda)
    code.write_text("x = 2\n")
    assert space_key(mod, cuda) != first and first != before
    assert space_key(mod, llvm) == before_llvm


def test_a_template_is_keyed_by_the_templates_whose_kernels_it_selects(tmp_path, monkeypatch):
    """The GEMM space's tensor-core sketch offers the wgmma template's kernels, whose code the builder swaps in: a
    change to the wgmma package changes the tensor-core template's key too."""
    before = code_digest(get("tensorcore"))
    code = tmp_path / "wgmma.py"
    code.write_text("x = 1\n")
    monkeypatch.setattr(type(get("wgmma")), "source_files", lambda self: [code])
    assert code_digest(get("tensorcore")) != before


@pytest.mark.parametrize("spec", [None, H200_CUDA], ids=["llvm", "cuda"])
def test_a_record_made_under_another_key_is_not_served(tmp_path, spec):
    same, other = _space_dirs(tmp_path)
    path, mod = tmp_path / "t.db", make_mod(16)
    tgt = target() if spec is None else target(spec)
    old = open_database(path, target=tgt, spaces_dir=same)
    old.commit_tuning_record(make_record(old, mod, 1e-5))
    old.set_task_name(mod, "add16")
    new = open_database(path, target=tgt, spaces_dir=other)
    assert new.trials_spent(mod) == 0 and new.best_run_secs(mod) is None
    assert new.query_tuning_record(mod, tgt.target, "main") is None
    assert len(new) == 0 and new.get_all_tuning_records() == [] and new.get_top_k(new.commit_workload(mod), 5) == []
    (stats,) = new.list_workloads()
    assert stats.trials == 0 and new.records(stats.workload_id) == []
    # the old handle, and one that reads every record, still see it
    assert old.trials_spent(mod) == 1 and len(old) == 1
    everything = open_database(path, target=tgt, keyed=False)
    assert everything.trials_spent(mod) == 1
    (row,) = everything.records(stats.workload_id)
    assert row.space_key == old.space_key_of(stats.workload_id) != new.space_key_of(stats.workload_id)
    for db in (old, new, everything):
        db.close()


def test_a_file_made_before_the_keys_gets_the_column_and_its_records_do_not_match(tmp_path):
    path, mod = tmp_path / "t.db", make_mod(16)
    db = open_database(path, target=target(), keyed=False)
    db.commit_tuning_record(make_record(db, mod, 1e-5))
    db.close()
    con = sqlite3.connect(path)
    con.execute("ALTER TABLE records DROP COLUMN space_key")   # the schema before the keys
    con.commit()
    con.close()
    db = open_database(path, target=target())
    assert db.store.keyed and db.trials_spent(mod) == 0 and db.query_tuning_record(mod, None, "main") is None
    db.commit_tuning_record(make_record(db, mod, 2e-5))
    assert db.trials_spent(mod) == 1 and db.best_run_secs(mod) == pytest.approx(2e-5)
    db.close()
