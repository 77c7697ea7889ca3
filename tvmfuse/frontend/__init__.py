"""Stage 1: load and validate an ONNX model, import it into Relax."""
from tvmfuse.frontend.importer import import_model
from tvmfuse.frontend.loader import LoadedModel, TensorSpec, load_model, parse_input_shapes

__all__ = ["LoadedModel", "TensorSpec", "load_model", "import_model", "parse_input_shapes"]
