"""Shared checks of the CUDA-template tests: ptxas on generated code, and a tuning record written to a database."""
from __future__ import annotations

import re
import subprocess

from tvmfuse._tvm import ms


def assert_ptxas_without_spills(src: str, tmp_path, arch: str, *, serialized: bool = False) -> None:
    """Build CUDA source ``src`` with nvcc for ``arch`` and require no register spills and no stack frame, and
    that ptxas kept the kernel's ``wgmma`` instructions asynchronous (``serialized``: require that it did not;
    ptxas reports "C7514 ... wgmma.mma_async instructions are serialized" where it cannot prove that no other
    instruction touches a wgmma's accumulators while it runs, and the tensor cores then wait on each)."""
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    out = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                          str(cu)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "0 bytes spill stores" in out.stderr and "0 bytes stack frame" in out.stderr, out.stderr[-800:]
    assert ("wgmma.mma_async instructions are serialized" in out.stderr) == serialized, out.stderr[-800:]
    # ptxas also waits for a wgmma itself where its accumulators are read before the kernel waits (C7517); in
    # the main loop that would undo any overlap, so each such wait must come before the first loop
    injected = [int(n) for n in re.findall(r"C7517\) warpgroup.wait is injected in around line (\d+)", out.stderr)]
    if injected:
        ptx = subprocess.run(["nvcc", f"-arch={arch}", "-ptx", "-o", "-", str(cu)], capture_output=True, text=True,
                             timeout=300).stdout.splitlines()
        first_loop = next(i + 1 for i, ln in enumerate(ptx) if ln.startswith("$L__BB0_"))
        assert all(n < first_loop for n in injected), (injected, first_loop)


def commit_record(db_path, target, kernel, trace, secs: float = 1e-3) -> None:
    """Store ``trace`` as a tuning record of ``kernel`` (a workload) in the tvmfuse database at ``db_path``."""
    from tvmfuse.db import open_database

    db = open_database(db_path, target=target)
    try:
        workload = db.ms_database.commit_workload(kernel.mod)
        db.ms_database.commit_tuning_record(ms.database.TuningRecord(
            trace, workload, [secs], target.target, ms.arg_info.ArgInfo.from_prim_func(kernel.mod["main"])))
    finally:
        db.close()


def build_with_record(db_path, target, fused, kernel, trace):
    """``compile``'s build of ``fused`` with ``trace`` stored as ``kernel``'s only tuning record."""
    from tvmfuse.compile.build import build
    from tvmfuse.db import open_database

    commit_record(db_path, target, kernel, trace)
    db = open_database(db_path, target=target)
    try:
        return build(fused, target=target, database=db)
    finally:
        db.close()
