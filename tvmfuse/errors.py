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
