"""Targets: llvm names this machine's CPU (its vector ISA, part of every record's key); a bad mcpu is refused."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tvmfuse.errors import TargetError
from tvmfuse.target import resolve_target

ROOT = Path(__file__).resolve().parents[1]


def test_llvm_targets_this_machines_cpu():
    from tvm.target import codegen

    spec = json.loads(resolve_target("llvm").canonical)
    assert spec["mcpu"] == str(codegen.llvm_get_system_cpu())
    # the records' key: a record tuned for another CPU (another ISA) is never this target's
    assert resolve_target('{"kind": "llvm", "mcpu": "x86-64"}').canonical != resolve_target("llvm").canonical


@pytest.mark.parametrize("mcpu", ["x86-64-v3", "skylake-avx512"])
def test_known_cpus_are_accepted(mcpu):
    assert json.loads(resolve_target(json.dumps({"kind": "llvm", "mcpu": mcpu})).canonical)["mcpu"] == mcpu


def test_an_unknown_mcpu_is_one_line_and_exit_2(tmp_path):
    with pytest.raises(TargetError, match="unknown mcpu 'pentium9'"):
        resolve_target('{"kind": "llvm", "mcpu": "pentium9"}')
    proc = subprocess.run([sys.executable, "-m", "tvmfuse.cli.main", "plan", "tvmfuse/data/example.onnx",
                           "--target", '{"kind": "llvm", "mcpu": "pentium9"}'], capture_output=True, text=True,
                          cwd=str(ROOT))
    assert proc.returncode == 2 and "unknown mcpu 'pentium9'" in proc.stderr
    assert "Traceback" not in proc.stderr
