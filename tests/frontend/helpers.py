"""Small ONNX models built with onnx.helper for the frontend tests (no torch needed)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh

from tvmfuse._tvm import relax, tvm


def matmul_model(*, batch: int | str = 2, k: int = 4, n: int = 4, opset: int = 17) -> onnx.ModelProto:
    """y = x @ W + b with a seeded W (16 floats) and b."""
    rng = np.random.default_rng(0)
    w = nh.from_array(rng.standard_normal((k, n)).astype(np.float32), "W")
    b = nh.from_array(rng.standard_normal((n,)).astype(np.float32), "b")
    g = h.make_graph(
        [h.make_node("MatMul", ["x", "W"], ["xw"]), h.make_node("Add", ["xw", "b"], ["y"])], "g",
        [h.make_tensor_value_info("x", TP.FLOAT, [batch, k])], [h.make_tensor_value_info("y", TP.FLOAT, [batch, n])], [w, b])
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)])


def save_external(model: onnx.ModelProto, folder: Path, *, location: str = "weights.bin") -> Path:
    """Save ``model`` with every initializer in one external file ``location``; return the .onnx path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    (folder / location).parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=0)
    return path


def set_location(path: Path, location: str, *, offset: int | None = None, length: int | None = None) -> None:
    """Rewrite every external reference of the model at ``path`` (without touching any data file)."""
    model = onnx.load_model(str(path), load_external_data=False)
    for t in model.graph.initializer:
        kv = {e.key: e.value for e in t.external_data}
        kv["location"] = location
        if offset is not None:
            kv["offset"] = str(offset)
        if length is not None:
            kv["length"] = str(length)
        del t.external_data[:]
        for key, value in kv.items():
            e = t.external_data.add()
            e.key, e.value = key, value
    path.write_bytes(model.SerializeToString())


def run_tvm(mod, inputs: list[np.ndarray]) -> np.ndarray:
    """Compile untuned on llvm and run main."""
    exe = tvm.compile(mod, tvm.target.Target({"kind": "llvm", "num-cores": 2}), relax_pipeline="default")
    vm = relax.VirtualMachine(exe, tvm.cpu(0))
    out = vm["main"](*[tvm.runtime.tensor(a) for a in inputs])
    return out.numpy() if hasattr(out, "numpy") else out[0].numpy()


def run_ort(model: onnx.ModelProto | Path, feeds: dict) -> np.ndarray:
    import onnxruntime as ort

    src = str(model) if isinstance(model, Path) else model.SerializeToString()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
