"""The deploy-side loader: an artifact folder -> a callable model. Needs only TVM's runtime and numpy."""
from tvmfuse.runtime.loaded import LoadedArtifact, load_artifact

__all__ = ["LoadedArtifact", "load_artifact"]
