"""The one place where tvmfuse touches TVM's moving API (TVM 0.27: ``s_tir``, ``tirx``, JSON targets).

Everything else imports TVM names from here, so the next rename is a one-file change.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types

import tvm
import tvm_ffi
from tvm import relax
from tvm.runtime import Tensor
from tvm.sym import Analyzer  # (TVM 0.27: tvm.arith became tvm.sym)
from tvm.target import Target
from tvm.tirx import PrimFunc

__all__ = [
    "tvm", "relax", "ms", "dlight", "tirx", "Target", "PrimFunc", "Tensor", "from_onnx", "Analyzer",
    "structural_hash", "structural_equal", "ensure_tensor_intrinsics", "register_mma_store", "build_context",
    "tvm_version", "is_scheduled", "param_buffers", "sblocks", "subexprs",
]

_TENSOR_INTRIN = "tvm.s_tir.tensor_intrin"


def __getattr__(name: str):
    # TVM's ONNX importer imports onnx: loaded on first use, so the deploy-side loader (tvmfuse.runtime), which
    # compiles CUDA through tvmfuse.nvcc_cache, imports no onnx
    if name == "from_onnx":
        from tvm.relax.frontend.onnx import from_onnx

        return from_onnx
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _install_lazy_tensor_intrin() -> None:
    """Make ``import tvm.s_tir.tensor_intrin`` cheap.

    Its ``__init__`` registers every tensor intrinsic of every backend by parsing TVMScript, which takes
    ~42 s of CPU here (29 s for CUDA alone). MetaSchedule imports it in every TuneContext and in every
    builder worker, so a 30 s build timeout kills every candidate. We register the package without
    running its ``__init__``; :func:`ensure_tensor_intrinsics` loads only the submodules a target needs.
    """
    if _TENSOR_INTRIN in sys.modules:
        return
    spec = importlib.util.find_spec(_TENSOR_INTRIN)
    if spec is None or not spec.submodule_search_locations:
        return
    pkg = types.ModuleType(_TENSOR_INTRIN)
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__package__ = _TENSOR_INTRIN
    pkg.__spec__ = spec
    sys.modules[_TENSOR_INTRIN] = pkg


_install_lazy_tensor_intrin()

import tvm.s_tir.meta_schedule as ms  # noqa: E402  (after the lazy tensor_intrin shim)
from tvm import tirx  # noqa: E402
from tvm.s_tir import dlight  # noqa: E402


def ensure_tensor_intrinsics(target_kind: str, *, tensor_cores: bool = False) -> None:
    """Register the tensor intrinsics a target's schedule rules may name (CUDA mma/wmma and tvmfuse's own, x86
    VNNI). Whatever replays a stored trace calls this first: a trace names its intrinsics, it does not carry them."""
    if target_kind == "cuda" and tensor_cores:
        importlib.import_module(_TENSOR_INTRIN + ".cuda")
        for out_dtype in ("float32", "float16"):
            register_mma_store(out_dtype)
    elif target_kind == "llvm":
        importlib.import_module(_TENSOR_INTRIN + ".x86")


def register_mma_store(out_dtype: str) -> str:
    """The name of tvmfuse's store of an m16n8k16 accumulator tile into static shared memory (TVM registers
    only its dynamic-shared and global stores), registered on first use."""
    from tvm.s_tir import TensorIntrin
    from tvm.s_tir.tensor_intrin.cuda import get_mma_store_intrin

    name = f"tvmfuse_mma_store_16x16_{out_dtype}_shared"
    try:
        TensorIntrin.get(name)
    except Exception:  # noqa: BLE001 - TVM raises a plain error for an unknown name
        TensorIntrin.register(name, *get_mma_store_intrin(out_dtype, 8, "shared", False))
    return name


# Pass options for every CUDA build tvmfuse makes (tuning candidates, kernel checks, the final build):
# shared-memory copies a schedule marks asynchronous (``software_pipeline_async_stages``) become cp.async.
BUILD_CONFIG = {"tirx.use_async_copy": True}


def build_context(*, cuda_graph: bool = False):
    """The PassContext tvmfuse builds under (see BUILD_CONFIG); ``cuda_graph``: Relax's RewriteCUDAGraph captures
    the static part of ``main`` (its kernel launches and allocations) as one CUDA graph, replayed on later calls."""
    config = dict(BUILD_CONFIG)
    if cuda_graph:
        config["relax.backend.use_cuda_graph"] = True
    return tvm.transform.PassContext(config=config)


def structural_hash(node) -> int:
    return int(tvm_ffi.structural_hash(node))


def structural_equal(a, b) -> bool:
    return bool(tvm_ffi.structural_equal(a, b))


def tvm_version() -> str:
    return str(tvm.__version__)


def is_scheduled(func: PrimFunc) -> bool:
    """Whether a PrimFunc carries a schedule (TVM 0.27 spells the attribute ``tirx.is_scheduled``)."""
    attrs = func.attrs
    if attrs is None:
        return False
    return any(key in attrs and bool(attrs[key]) for key in ("tirx.is_scheduled", "tir.is_scheduled"))


def param_buffers(func: PrimFunc) -> list:
    """The buffers of ``func``'s parameters (TVM 0.27: the parameters are typed buffers; earlier: ``buffer_map``)."""
    return [func.buffer_map[p] if hasattr(func, "buffer_map") else p for p in func.params]


def sblocks(func: PrimFunc) -> list:
    """Every block of ``func`` under its root, nested ones too (TVM 0.27 exposes no TIR visitor to Python:
    ``tvm.tirx.stmt_functor`` is gone), as ``SBlock`` nodes with their read and write regions."""
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    found, todo = [], list(sch.get_child_blocks(sch.get_sblock("root")))
    while todo:
        b = todo.pop(0)
        found.append(sch.get(b))
        todo.extend(sch.get_child_blocks(b))
    return found


def subexprs(expr):
    """``expr`` and every expression under it, walked by hand (TVM 0.27 has no Python TIR visitor)."""
    stack = [expr]
    while stack:
        e = stack.pop()
        yield e
        for field in ("a", "b", "value", "condition", "true_value", "false_value"):
            child = getattr(e, field, None)
            if isinstance(child, tvm.ir.expr.Expr):
                stack.append(child)
        for child in [*(getattr(e, "args", None) or ()), *(getattr(e, "indices", None) or ())]:
            if isinstance(child, tvm.ir.expr.Expr):
                stack.append(child)


def onnx_supported_ops() -> frozenset[str]:
    """ONNX op types TVM's Relax importer converts (its converter map plus ops it handles inline)."""
    from tvm.relax.frontend.onnx import onnx_frontend

    return frozenset(onnx_frontend._get_convert_map()) | {"If", "Constant"}


from tvm.ir.utils import derived_object  # noqa: E402  (for MetaSchedule Py* subclasses)

__all__ += ["derived_object", "onnx_supported_ops"]


def const_value(const) -> Tensor:
    """The tensor a Relax constant holds (TVM 0.27: ``GenericConst.value``; earlier: ``Constant.data``)."""
    return const.value if hasattr(const, "value") else const.data


__all__ += ["const_value"]


def save_json(node) -> str:
    """Serialize a TVM object (an IRModule) as TVM's JSON graph text (``tvm.ir.save_json`` in 0.27)."""
    return str(tvm.ir.save_json(node))


def load_json(text: str):
    """Inverse of :func:`save_json` (``tvm.ir.load_json`` in 0.27; upgrades older JSON)."""
    return tvm.ir.load_json(text)


__all__ += ["save_json", "load_json"]


# --- Relax IR names as TVM 0.27 spells them (StructInfo became ``Type`` on ``.ty``; Constant moved to
# ``tvm.ir``; ``Var.name_hint`` became ``Var.name``). Appended for the fusion planner (tvmfuse/plan).
RelaxConstant = tvm.ir.Constant
TensorType = relax.TensorType
TupleType = relax.TupleType


def expr_type(expr):
    """The Relax type (0.26's struct info) of an expression or var."""
    return expr.ty


def var_name(var) -> str:
    return str(var.name)


def const_numpy(const):
    """A Relax constant's value as a numpy array."""
    return const.value.numpy()


__all__ += ["RelaxConstant", "TensorType", "TupleType", "expr_type", "var_name", "const_numpy"]


def estimate_flops(mod_or_func) -> float:
    """TVM's static FLOP estimate of a PrimFunc or IRModule (0.27: ``tvm.s_tir.analysis``)."""
    from tvm.s_tir.analysis import estimate_tir_flops

    return float(estimate_tir_flops(mod_or_func))


__all__ += ["estimate_flops"]


def _guard_ms_logging() -> None:
    """Let MetaSchedule configure its loggers when foreign handlers sit on them.

    MetaSchedule's ``create_loggers`` lists the names of the handlers already on its logger in a
    ``dictConfig`` template and formats each name; a handler without a name (pytest attaches its capture
    handler to every non-propagating logger; a user's notebook may add one) makes it raise
    ``'NoneType' object has no attribute 'format'``. ``dictConfig`` replaces the logger's handlers anyway,
    so unnamed ones are dropped first.
    """
    import logging

    from tvm.s_tir.meta_schedule import logging as ms_logging

    original = ms_logging.create_loggers
    if getattr(original, "_tvmfuse_guarded", False):
        return

    def create_loggers(*args, **kwargs):
        logger = logging.getLogger("tvm.s_tir.meta_schedule")
        for handler in [h for h in logger.handlers if h.get_name() is None]:
            logger.removeHandler(handler)
        return original(*args, **kwargs)

    create_loggers._tvmfuse_guarded = True
    ms_logging.create_loggers = create_loggers


_guard_ms_logging()


def _lazy_script_stacks() -> None:
    """TVMScript's decorators (``T.prim_func``, ``I.ir_module``, ``R.function``) call ``inspect.stack()``, which finds
    every frame's source and, for a frame with no file (the TVMScript evaluator's ``<ast>`` code), scans every loaded
    module: 80-90% of registering TVM's CUDA tensor intrinsics (11.6 of 13.7 s in a bare process, 31 s under pytest)
    and of parsing tvmfuse's TVMScript templates. They read only frames[2]'s code line and the frames' locals, so
    their ``stack`` records the frames and builds each ``FrameInfo`` (as ``inspect.stack()``) when it is read."""
    import inspect
    from collections.abc import Sequence

    class LazyStack(Sequence):
        def __init__(self, frames, context):
            self.frames, self.context = frames, context

        def __len__(self):
            return len(self.frames)

        def __getitem__(self, i):
            if isinstance(i, slice):   # ``outer_stack[1:]``: read as lazily
                return LazyStack(self.frames[i], self.context)
            info = inspect.getframeinfo(self.frames[i], self.context)
            extra = {"positions": info.positions} if hasattr(info, "positions") else {}   # Python 3.11+
            return inspect.FrameInfo(self.frames[i], *info, **extra)

    def stack(context=1):
        frames = [sys._getframe(1)]
        while frames[-1].f_back is not None:
            frames.append(frames[-1].f_back)
        return LazyStack(frames, context)

    lazy = type("LazyInspect", (types.ModuleType,), {"__getattr__": lambda _, name: getattr(inspect, name)})("")
    lazy.stack = stack
    for name in ("tvm.tirx.script.parser.entry", "tvm.script.parser.ir.entry", "tvm.relax.script.parser.entry"):
        module = importlib.import_module(name)
        if getattr(module, "inspect", None) is inspect:
            module.inspect = lazy


_lazy_script_stacks()


def _to_plain(obj):
    """A trace's JSON value (Array/Map/IntImm/str) as plain Python. Other objects (the IndexMap argument of
    ``transform_layout``) become their TVM JSON-graph text, the form ``Trace`` parses back."""
    from tvm_ffi import Array, Map

    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, tvm.tirx.IntImm | tvm.tirx.FloatImm):
        return obj.value
    if isinstance(obj, Array | list | tuple):
        return [_to_plain(x) for x in obj]
    if isinstance(obj, Map | dict):
        return {str(_to_plain(k)): _to_plain(v) for k, v in obj.items()}
    text = tvm.ir.save_json(obj).strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise TypeError(f"cannot store a {type(obj).__name__} in a tuning record")
    return text


def record_to_json(record) -> list:
    """``TuningRecord.as_json()`` that also carries traces with ``transform_layout`` (TVM 0.27's converter
    raises on their IndexMap arguments, which the trace parser expects as JSON-graph text)."""
    return _to_plain(ms._ffi_api.TuningRecordAsJSON(record))


def record_from_json(obj, workload):
    """``TuningRecord.from_json`` that first registers the tensor intrinsics a tensorized trace names."""
    insts = obj[0][0] if obj and obj[0] else []
    if any(isinstance(i, list) and i and i[0] == "Tensorize" for i in insts):
        kind = obj[2].get("kind", "cuda") if len(obj) > 2 and isinstance(obj[2], dict) else "cuda"
        ensure_tensor_intrinsics(str(kind), tensor_cores=True)
    return ms.database.TuningRecord.from_json(obj, workload)


# --- CUDA compilation. TVM 0.27 keeps a CUDA module's source (``tvm.compile`` and ``export_library`` run no compiler);
# the CUDA runtime compiles it when the module is loaded on a GPU (``CUDAModuleNode::JitCompileFromSource``) by
# calling the global function below with the source alone. TVM's own (``tvm.support.nvcc``; ``tvm.contrib.nvcc``
# before 0.27) reads the arch from the current target, else from the GPU, and compiles with NVRTC, or with nvcc
# under ``TVM_CUDA_COMPILE_MODE=nvcc``, with flags some ``TVM_*`` variables change.
CUDA_COMPILE_FUNC = "tvm_callback_cuda_compile"
_CUDA_FLAG_ENV = ("TVM_CUDA_COMPILE_MODE", "TVM_CUDA_PTXAS_REG_LEVEL", "TVM_CUDA_PTXAS_EXTRA_OPTS",
                  "TVM_CUDA_NVCC_NO_FAST_MATH", "TVM_KERNEL_DEBUG")


def tvm_cuda_compile():
    """TVM's own CUDA compile callback (the function itself, not whatever is registered under its name now)."""
    from tvm.support import nvcc

    return nvcc.tvm_callback_cuda_compile


def register_cuda_compile(fn) -> None:
    """Make ``fn(code, *rest) -> bytes`` the CUDA compile callback of this process."""
    tvm_ffi.register_global_func(CUDA_COMPILE_FUNC, fn, override=True)


def cuda_compile(code: str) -> bytes:
    """Compile CUDA source through the registered callback, as the CUDA runtime does at load (the arch from the
    current target, else the GPU)."""
    return bytes(tvm_ffi.get_global_func(CUDA_COMPILE_FUNC)(code))


@functools.lru_cache(maxsize=8)
def _compiler_version(mode: str, nvcc_path: str | None, nvcc_mtime: int) -> str | None:
    import subprocess

    if mode == "nvcc":
        if nvcc_path is None:
            return None
        out = subprocess.run([nvcc_path, "--version"], capture_output=True, text=True, timeout=60)
        return out.stdout.strip() if out.returncode == 0 else None
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return None
    _err, major, minor = nvrtc.nvrtcVersion()
    return f"nvrtc {major}.{minor}"


def cuda_compile_settings(code: str) -> dict | None:
    """Everything besides the source that decides what TVM's compile callback returns here: the arch, the compiler
    and its version, the ``TVM_*`` variables that change its flags, and TVM's version (its fixed flags live in its
    code). None where the output is not a function of these alone, or is not to be reused: no arch known (no target,
    no GPU), no compiler, kernels dumped as a side effect (``TVM_KERNEL_DUMP``, ``cuda.kernels_output_dir``), or
    NVSHMEM code (linked against the machine's library)."""
    import os
    import shutil

    from tvm.support import nvcc

    if os.environ.get("TVM_KERNEL_DUMP") is not None or "nvshmem" in code:
        return None
    if "cuda.kernels_output_dir" in tvm.transform.PassContext.current().config:
        return None
    try:
        arch = nvcc.get_target_compute_version(Target.current(allow_none=True))
    except Exception:  # noqa: BLE001 - TVM's own callback raises its error for this
        return None
    mode = os.environ.get("TVM_CUDA_COMPILE_MODE", "nvrtc").lower()
    path = shutil.which("nvcc")
    version = _compiler_version(mode, path, os.stat(path).st_mtime_ns if path else 0)
    if version is None:
        return None
    return {"arch": arch, "mode": mode, "compiler": version, "tvm": tvm_version(),
            "env": {k: os.environ.get(k) for k in _CUDA_FLAG_ENV}}


def cuda_sources(module) -> list[str]:
    """The CUDA source of each CUDA module a built module (or executable) holds, as the runtime will compile it."""
    mods = [module.mod if hasattr(module, "mod") else module]
    seen, out = set(), []
    while mods:
        m = mods.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if m.kind == "cuda":
            out.append(str(m.inspect_source("cuda")))
        mods.extend(m.imports)
    return out


__all__ += ["CUDA_COMPILE_FUNC", "tvm_cuda_compile", "register_cuda_compile", "cuda_compile", "cuda_compile_settings",
            "cuda_sources"]
