"""benchmarks/wgmma_gemm.py's sweep of a shape's whole space: the kernels built ahead in worker processes (the GPU
checks and times them; here, without one, they are built and exported only)."""
from __future__ import annotations

import shutil

import pytest

from benchmarks.wgmma_gemm import _prebuild, conv_spec
from tvmfuse.kernels.wgmma import configs


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernels_are_built_ahead_in_worker_processes(tmp_path):
    """Two configs of ResNet-50's 14^2 conv, each built by a spawned worker into a library the timing loads; a
    config the kernel cannot take comes back as its error, not a crash of the pool."""
    from dataclasses import replace

    spec = conv_spec(32, 256, 14, 256)
    good = configs(spec)[:2]
    bad = replace(good[0], block_k=48)   # no K step of 48: the kernel generator refuses it
    futures = _prebuild([(spec, [*good, bad])], 2, tmp_path)
    for cfg in good:
        path, error, seconds = futures[(spec, cfg)].result()
        assert error is None and path.startswith(str(tmp_path)) and path.endswith(".so") and seconds > 0
    path, error, _ = futures[(spec, bad)].result()
    assert path is None and error.startswith("error:"), error   # TVM's diagnostic line, not its carets
    assert _prebuild([(spec, good)], 1) == {}   # one job: built in the timing loop, as before
