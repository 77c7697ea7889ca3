"""Link a library for another machine: zig's ``cc`` (the ``ziglang`` wheel, ``pip install 'tvmfuse[cross]'``)
as ``export_library``'s compiler when the target's triple is another CPU architecture than this machine's.

Why zig: LLVM already writes the object files for any triple; what a cross build lacks is a linker and a libc
for the other machine. The ``ziglang`` wheel carries both for every architecture zig supports, installs with
pip (no system packages, no sysroot), and is a clang driver (``zig cc -target aarch64-linux-gnu``).
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys

from tvmfuse.errors import TargetError
from tvmfuse.machine import host_arch, zig_triple
from tvmfuse.target import TargetInfo


def zig_available() -> bool:
    return importlib.util.find_spec("ziglang") is not None


class ZigLinker:
    """``export_library``'s ``fcompile``: link the objects into a shared library for ``triple`` with zig.

    A class, not a closure, so that it pickles (MetaSchedule's builder sends its export function to workers)."""

    def __init__(self, triple: str):
        self.triple = zig_triple(triple)

    def command(self, output: str, objects, options=None) -> list[str]:
        objects = [objects] if isinstance(objects, str) else list(objects)
        return [sys.executable, "-m", "ziglang", "cc", "-target", self.triple, "-shared", "-fPIC", "-o", output,
                *(options or []), *objects]

    def __call__(self, output: str, objects, options=None, **_unused) -> None:
        cmd = self.command(output, objects, options)
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"zig cc failed to link for {self.triple}:\n{done.stdout}{done.stderr}\n"
                               f"command: {' '.join(cmd)}")

    def get_target_triple(self) -> str:  # export_library asks this when the module has no LLVM part
        return self.triple


def export_options(target: TargetInfo) -> dict:
    """Keyword arguments for ``export_library`` that link for ``target``'s machine: none for this machine's own
    architecture (the system's ``cc``), zig for another. Raises TargetError (exit 2) when a cross build needs
    zig and the ``ziglang`` package is not installed."""
    if not target.foreign:
        return {}
    if not zig_available():
        raise TargetError(f"building for {target.triple} on this {host_arch()} machine needs a cross linker: the "
                          "ziglang package is not installed", hint="pip install 'tvmfuse[cross]' (or ziglang)")
    return {"fcompile": ZigLinker(target.triple)}
