"""Errors a user can act on. The CLI prints them as one line and exits with ``exit_code``."""
from __future__ import annotations


class TvmfuseError(Exception):
    """A failure caused by the input or the environment, not by a bug in tvmfuse.

    ``str(err)`` is the one line the CLI prints; ``exit_code`` is 2 for bad input.
    """

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        msg = super().__str__()
        return f"{msg} ({self.hint})" if self.hint else msg


class ModelError(TvmfuseError):
    """The ONNX file is missing, unreadable, invalid, or uses something the importer cannot handle."""


class UnsupportedOpError(ModelError):
    def __init__(self, op_type: str, node: str, opset: int | None = None):
        where = f"node '{node}'" + (f", opset {opset}" if opset is not None else "")
        super().__init__(f"unsupported ONNX operator '{op_type}' at {where}")
        self.op_type, self.node, self.opset = op_type, node, opset


class TargetError(TvmfuseError):
    """The target cannot be parsed or is not available on this machine."""


class DatabaseError(TvmfuseError):
    """The tuning database cannot be opened or is damaged."""


class ArtifactError(TvmfuseError):
    """An artifact folder is missing, incomplete, or fails its hash check."""


class VerificationError(TvmfuseError):
    """Outputs disagree with the reference beyond tolerance."""

    exit_code = 1


def headline(err: BaseException, limit: int = 300) -> str:
    """An exception's message on one line: its first paragraph, lines joined, up to the kernel source or traceback
    TVM appends. A failed CUDA launch says which kernel and grid on the lines after its first ("CUDALaunch Error:
    CUDA_ERROR_INVALID_VALUE | grid=(512,1,1), block=(128,1,1) | // func_name=..."): the first line alone named
    no kernel."""
    lines: list[str] = []
    for line in str(err).strip().splitlines():
        line = line.strip()
        if not line or line.startswith(("// CUDA Source", "Traceback", "File ")):
            break
        lines.append(line)
    return " | ".join(lines)[:limit] or type(err).__name__
