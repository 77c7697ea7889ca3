"""A content-addressed cache of CUDA compiler output, shared by every process that compiles tvmfuse's kernels.

The same CUDA source is compiled many times: a template's configs whose knobs leave the source alone, the same
kernel in another model or run, the default schedule measured again on resume. Each compile takes seconds of
nvcc (or NVRTC). :func:`install` puts a cache in front of TVM's compile callback in this process; the tuner
installs it in its build and measurement workers too (:func:`worker_initializer`), and ``tvmfuse rpc server`` in
the processes its sessions fork from.

An entry's key is the sha256 of the source and of everything else that decides the output
(``tvmfuse._tvm.cuda_compile_settings``: arch, compiler and its version, flags, TVM's version); its value is the
compiler's output (PTX, cubin or fatbin) behind a header holding its length and sha256, so a torn or damaged
entry is found, removed and compiled again. Entries are written to a temporary file and renamed into place
(concurrent writers and killed processes never leave half an entry); a hit refreshes the entry's time, and the
oldest entries go once the folder passes ``max_bytes``.

The folder: ``TVMFUSE_NVCC_CACHE`` (``off`` turns the cache off), else ``$XDG_CACHE_HOME/tvmfuse/nvcc``
(``~/.cache/tvmfuse/nvcc``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tvmfuse import _tvm

ENV = "TVMFUSE_NVCC_CACHE"
OFF = "off"
DEFAULT_MAX_BYTES = 2 * 1024 ** 3
_MAGIC = b"tvmfuse-nvcc-cache 1 "
_SUFFIX = ".bin"

log = logging.getLogger("tvmfuse.nvcc_cache")


def default_dir() -> Path | None:
    """The cache folder the environment names, or None where ``TVMFUSE_NVCC_CACHE=off``."""
    env = os.environ.get(ENV, "").strip()
    if env.lower() == OFF:
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or str(Path.home() / ".cache")
    return Path(base) / "tvmfuse" / "nvcc"


@dataclass
class Stats:
    """This process's counts (the workers keep their own; their hits show as entries' refreshed times)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0    # entries that failed their digest check (removed, compiled again)
    evicted: int = 0


class NvccCache:
    """The cache folder: ``get``/``put`` by key, ``compile`` = get, else compile and put."""

    def __init__(self, directory: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES):
        self.directory = Path(directory)
        self.max_bytes = int(max_bytes)
        self.stats = Stats()
        self._approx_bytes: int | None = None   # the folder's size as of the last scan plus what was put since

    @staticmethod
    def key(source: str, settings: dict) -> str:
        blob = json.dumps({"source": source, "settings": settings}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def path(self, key: str) -> Path:
        return self.directory / key[:2] / (key + _SUFFIX)

    def entries(self) -> list[Path]:
        return sorted(self.directory.glob("*/*" + _SUFFIX)) if self.directory.is_dir() else []

    def get(self, key: str) -> bytes | None:
        path = self.path(key)
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        data = _unpack(blob)
        if data is None:
            self.stats.corrupt += 1
            log.warning("nvcc cache: damaged entry %s removed (compiling again)", path)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)   # a hit: the entry is recent again (eviction takes the oldest)
        except OSError:
            pass
        return data

    def put(self, key: str, data: bytes) -> None:
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_pack(data))
            os.replace(tmp, path)   # atomic: readers see the old entry, the new one, or none
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        if self._approx_bytes is not None:
            self._approx_bytes += len(data) + 128
        if self._approx_bytes is None or self._approx_bytes > self.max_bytes:
            self.evict()

    def evict(self) -> None:
        """Remove the least recently used entries until the folder holds at most 90% of ``max_bytes``."""
        sized = []
        for p in self.entries():
            try:
                st = p.stat()
            except OSError:
                continue
            sized.append((st.st_mtime_ns, st.st_size, p))
        total = sum(s for _, s, _ in sized)
        if total > self.max_bytes:
            for _, size, p in sorted(sized):
                if total <= 0.9 * self.max_bytes:
                    break
                p.unlink(missing_ok=True)
                total -= size
                self.stats.evicted += 1
        self._approx_bytes = total

    def compile(self, source: str, settings: dict, compile_fn: Callable[[], bytes]) -> bytes:
        key = self.key(source, settings)
        data = self.get(key)
        if data is not None:
            self.stats.hits += 1
            log.debug("nvcc cache hit %s", key[:16])
            return data
        self.stats.misses += 1
        data = bytes(compile_fn())
        try:
            self.put(key, data)
        except OSError as e:   # a full or read-only disk: the compile still counts
            log.warning("nvcc cache: cannot store %s (%s)", key[:16], e)
        log.debug("nvcc cache miss %s (%d bytes stored)", key[:16], len(data))
        return data


def _pack(data: bytes) -> bytes:
    return _MAGIC + f"{len(data)} {hashlib.sha256(data).hexdigest()}\n".encode() + data


def _unpack(blob: bytes) -> bytes | None:
    """The entry's data, or None where its header, length or digest does not match."""
    if not blob.startswith(_MAGIC):
        return None
    header, sep, data = blob[len(_MAGIC):].partition(b"\n")
    try:
        size, digest = header.decode().split()
    except (UnicodeDecodeError, ValueError):
        return None
    if not sep or len(data) != int(size) or hashlib.sha256(data).hexdigest() != digest:
        return None
    return data


_installed: NvccCache | None = None


def install(directory: str | Path | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES) -> NvccCache | None:
    """Put the cache in front of TVM's CUDA compile callback in this process, in ``directory`` (default:
    :func:`default_dir`; ``"off"``: TVM's own callback, uncached). Returns the cache, or None when off."""
    global _installed
    folder = default_dir() if directory is None else (None if str(directory).lower() == OFF else Path(directory))
    if folder is None:
        if _installed is not None:
            _tvm.register_cuda_compile(_tvm.tvm_cuda_compile())
        _installed = None
        return None
    if _installed is not None and _installed.directory == folder:
        _installed.max_bytes = int(max_bytes)
        return _installed
    cache = NvccCache(folder, max_bytes=max_bytes)
    original = _tvm.tvm_cuda_compile()

    def cached_compile(code, *rest):
        settings = _tvm.cuda_compile_settings(code)
        if settings is None:
            return original(code, *rest)
        return cache.compile(str(code), settings, lambda: original(code, *rest))

    _tvm.register_cuda_compile(cached_compile)
    _installed = cache
    return cache


def installed() -> NvccCache | None:
    """The cache this process compiles through, if any."""
    return _installed


def worker_initializer() -> Callable[[], None]:
    """An initializer for MetaSchedule's worker pools that installs this process's cache (its folder, or off)."""
    folder = str(_installed.directory) if _installed is not None else OFF
    max_bytes = _installed.max_bytes if _installed is not None else DEFAULT_MAX_BYTES
    return functools.partial(_install_quietly, folder, max_bytes)


def _install_quietly(folder: str, max_bytes: int) -> None:
    install(folder, max_bytes=max_bytes)
