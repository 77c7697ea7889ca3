"""Which machine a build is for (tvmfuse.machine) and the targets that name another one (tvmfuse.target)."""
from __future__ import annotations

import pytest

from tvmfuse.machine import (cuda_arch_runs_on, cuda_capability, host_arch, is_foreign_triple, machine_mismatch,
                             triple_arch, zig_triple)


def test_triples_and_their_architectures():
    assert triple_arch("aarch64-linux-gnu") == "aarch64"
    assert triple_arch("arm64-apple-darwin") == "aarch64"
    assert triple_arch("x86_64-conda-linux-gnu") == "x86_64"
    assert not is_foreign_triple(None) and not is_foreign_triple(f"{host_arch()}-unknown-linux-gnu")
    assert is_foreign_triple("riscv64-linux-gnu")


@pytest.mark.parametrize("llvm, zig", [("aarch64-linux-gnu", "aarch64-linux-gnu"),
                                       ("aarch64-unknown-linux-gnu", "aarch64-linux-gnu"),
                                       ("x86_64-pc-linux-gnu", "x86_64-linux-gnu"),
                                       ("aarch64-unknown-linux", "aarch64-linux-gnu"),
                                       ("arm64-linux-musl", "aarch64-linux-musl")])
def test_zig_takes_llvm_triples_without_their_vendor(llvm, zig):
    assert zig_triple(llvm) == zig


def test_cuda_arches_run_on_their_major_and_arch_specific_ones_only_on_their_own_capability():
    assert cuda_capability("sm_90a") == (9, 0, "a") and cuda_capability("sm_120") == (12, 0, "")
    assert cuda_arch_runs_on("sm_80", 8, 6) and not cuda_arch_runs_on("sm_86", 8, 0)
    assert not cuda_arch_runs_on("sm_80", 9, 0)  # a cubin does not cross majors
    assert cuda_arch_runs_on("sm_90a", 9, 0) and not cuda_arch_runs_on("sm_90a", 9, 1)


def test_an_artifact_for_another_cpu_is_refused_with_one_sentence():
    other = "riscv64" if host_arch() != "riscv64" else "aarch64"
    why = machine_mismatch({"arch": other, "triple": f"{other}-linux-gnu", "cuda_arch": None})
    assert why.startswith(f"the artifact was built for {other}") and host_arch() in why and "\n" not in why
    assert machine_mismatch({"arch": host_arch(), "triple": None, "cuda_arch": None}) is None
    assert machine_mismatch({}) is None  # manifests from before `machine` existed


def test_a_cross_target_carries_no_host_cpu_and_names_its_machine():
    from tvmfuse.target import resolve_target

    t = resolve_target("aarch64")
    assert t.canonical == '{"kind":"llvm","mtriple":"aarch64-linux-gnu"}'
    assert t.machine() == {"arch": "aarch64", "triple": "aarch64-linux-gnu", "cuda_arch": None}
    if host_arch() != "aarch64":
        assert t.foreign and not t.runs_here() and t.device == "cpu:aarch64-linux-gnu"
    native = resolve_target("llvm")
    assert not native.foreign and native.runs_here() and native.machine()["arch"] == host_arch()
    gpu = resolve_target('{"kind": "cuda", "arch": "sm_80"}')
    assert gpu.machine()["cuda_arch"] == "sm_80" and gpu.machine()["arch"] == host_arch()
