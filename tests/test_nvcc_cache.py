"""The nvcc output cache (tvmfuse/nvcc_cache.py) with real nvcc: a second compile of the same CUDA source is a hit with
the same bytes (those of TVM's own uncached compile), a changed source misses, a damaged entry is found and compiled
again, ``TVMFUSE_NVCC_CACHE=off`` leaves TVM's compile alone, the oldest entries go past the size bound, and the
tuner's build workers compile through the cache. Each test has its own cache folder (never the user's)."""
from __future__ import annotations

import re
import shutil
import time

import pytest

from tvmfuse import nvcc_cache
from tvmfuse._tvm import cuda_compile, cuda_sources, dlight, tvm, tvm_cuda_compile
from tvmfuse.target import resolve_target

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

FATBIN_MAGIC = (0xBA55ED50).to_bytes(4, "little")


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.setenv("TVM_CUDA_COMPILE_MODE", "nvcc")   # (TVM's default, NVRTC, needs cuda-bindings: not here)
    yield resolve_target("cuda")
    nvcc_cache.install(nvcc_cache.OFF)   # TVM's own callback again for the tests after


def _mod(add: float):
    from tvm import te

    a = te.placeholder((1024,), "float32", name="a")
    b = te.compute((1024,), lambda i: a[i] + add, name="b")
    return tvm.IRModule({"main": te.create_prim_func([a, b]).with_attr("global_symbol", "main")})


def _scheduled(add: float, target):
    with target:
        return dlight.ApplyDefaultSchedule(dlight.gpu.Fallback())(_mod(add))


def _source(add: float, cuda) -> str:
    (src,) = cuda_sources(tvm.compile(_scheduled(add, cuda.target), target=cuda.target))
    return src


def _compile(src: str, cuda) -> bytes:
    with cuda.target:   # as the builder compiles (the runtime's load reads the GPU's arch instead: the same here)
        return cuda_compile(src)


def test_a_second_compile_is_a_hit_with_the_bytes_of_an_uncached_compile(tmp_path, cuda):
    cache = nvcc_cache.install(tmp_path)
    src = _source(1.0, cuda)
    first = _compile(src, cuda)
    assert (cache.stats.misses, cache.stats.hits, len(cache.entries())) == (1, 0, 1)
    second = _compile(src, cuda)
    assert (cache.stats.misses, cache.stats.hits, len(cache.entries())) == (1, 1, 1)
    assert second == first
    with cuda.target:
        assert bytes(tvm_cuda_compile()(src)) == first   # TVM's own compile, uncached: byte for byte
    # a fatbin holding the kernel, for the target's arch
    kernel = re.search(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(', src).group(1)
    assert first.startswith(FATBIN_MAGIC) and kernel.encode() in first


def test_a_changed_source_or_arch_misses(tmp_path, cuda):
    cache = nvcc_cache.install(tmp_path)
    a, b = _compile(_source(1.0, cuda), cuda), _compile(_source(2.0, cuda), cuda)
    assert a != b and (cache.stats.misses, cache.stats.hits, len(cache.entries())) == (2, 0, 2)
    settings = {"arch": "9.0.a", "mode": "nvcc"}
    assert cache.key("x", settings) != cache.key("x", {**settings, "arch": "8.0"})
    assert cache.key("x", settings) != cache.key("y", settings)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_entry_is_found_and_compiled_again(tmp_path, cuda, damage):
    cache = nvcc_cache.install(tmp_path)
    src = _source(1.0, cuda)
    good = _compile(src, cuda)
    (entry,) = cache.entries()
    blob = entry.read_bytes()
    if damage == "truncate":   # a writer killed midway (what the rename into place prevents) or a full disk
        entry.write_bytes(blob[: len(blob) // 2])
    else:                      # the same length, one bit off
        entry.write_bytes(blob[:-10] + bytes([blob[-10] ^ 1]) + blob[-9:])
    assert _compile(src, cuda) == good
    assert (cache.stats.corrupt, cache.stats.misses, cache.stats.hits) == (1, 2, 0)
    assert entry.read_bytes() == blob   # stored again, whole
    assert _compile(src, cuda) == good and cache.stats.hits == 1


def test_off_leaves_tvms_compile_alone(tmp_path, cuda, monkeypatch):
    monkeypatch.setenv(nvcc_cache.ENV, str(tmp_path / "here"))
    assert nvcc_cache.default_dir() == tmp_path / "here"
    monkeypatch.setenv(nvcc_cache.ENV, "off")
    assert nvcc_cache.default_dir() is None
    nvcc_cache.install(tmp_path / "on")
    assert nvcc_cache.install() is None and nvcc_cache.installed() is None
    assert _compile(_source(1.0, cuda), cuda).startswith(FATBIN_MAGIC)
    assert not (tmp_path / "on").exists() or not any((tmp_path / "on").iterdir())
    monkeypatch.delenv(nvcc_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert nvcc_cache.default_dir() == tmp_path / "xdg" / "tvmfuse" / "nvcc"


def test_the_oldest_entries_go_past_the_size_bound(tmp_path):
    cache = nvcc_cache.NvccCache(tmp_path, max_bytes=1200)   # three entries of 300 bytes (390 with the header)
    for n in range(3):
        cache.put(f"{n:02d}" + "0" * 62, bytes(300))
        time.sleep(0.01)
    assert len(cache.entries()) == 3
    assert cache.get("00" + "0" * 62) == bytes(300)   # a hit: the first entry is the most recent now
    cache.put("03" + "0" * 62, bytes(300))   # past the bound: the least recently used go, down to 90% of it
    left = sorted(p.name[:2] for p in cache.entries())
    assert left == ["00", "03"] and cache.stats.evicted == 2
    assert not list(tmp_path.glob("*/.tmp-*"))   # no temporary file left behind


def test_the_tuners_build_workers_compile_through_the_cache(tmp_path, cuda):
    """MetaSchedule's LocalBuilder as the tuner makes it, in its own worker processes: the first build stores the
    candidate's compiled kernel, the second is a hit there (the entry refreshed, nothing new stored)."""
    from tvmfuse._tvm import ms
    from tvmfuse.tune.builder import close_builder, make_builder

    cache = nvcc_cache.install(tmp_path)
    builder = make_builder(workers=1, timeout_s=300, precompile=True)
    inputs = [ms.builder.BuilderInput(_scheduled(3.0, cuda.target), cuda.target)]
    try:
        (first,) = builder.build(inputs)
        assert first.error_msg is None, first.error_msg
        (entry,) = cache.entries()
        stamp = entry.stat().st_mtime_ns
        time.sleep(0.05)
        (second,) = builder.build(inputs)
    finally:
        close_builder(builder)
    assert second.error_msg is None, second.error_msg
    assert cache.entries() == [entry] and entry.stat().st_mtime_ns > stamp
    assert cache.stats.misses == cache.stats.hits == 0   # all of it in the workers
    # and it is the kernel this process would compile: a hit here too
    assert _compile(_source(3.0, cuda), cuda) and (cache.stats.hits, cache.stats.misses) == (1, 0)
