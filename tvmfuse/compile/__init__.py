"""Stage 5: apply the best records, build, and export a deployable artifact folder."""
from tvmfuse.compile.artifact import export_artifact
from tvmfuse.compile.build import BuildResult, KernelStatus, apply_records, build

__all__ = ["BuildResult", "KernelStatus", "apply_records", "build", "export_artifact"]
