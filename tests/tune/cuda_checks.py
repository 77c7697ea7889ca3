"""Shared checks of the CUDA-template tests: ptxas on generated code, and a tuning record written to a database."""
from __future__ import annotations

import re
import subprocess

from tvmfuse._tvm import ms, tvm

# the CPU builds of a kernel's emulation (its threads as loops) and of the planner's function it is compared
# with: LLVM without its optimizer, whose passes were most of each build's time (0.30 of 0.34 s for a 16-row
# GEMV's emulated kernel); they change no result: none of these builds allows fast math
EMULATE = tvm.target.Target({"kind": "llvm", "opt-level": 0})


def assert_ptxas_without_spills(src: str, tmp_path, arch: str, *, serialized: bool = False) -> str:
    """Build CUDA source ``src`` with nvcc for ``arch`` and require no register spills and no stack frame, and
    that ptxas kept the kernel's ``wgmma`` instructions asynchronous (``serialized``: require that it did not;
    ptxas reports "C7514 ... wgmma.mma_async instructions are serialized" where it cannot prove that no other
    instruction touches a wgmma's accumulators while it runs, and the tensor cores then wait on each). Returns
    ptxas's report."""
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    out = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                          str(cu)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "0 bytes spill stores" in out.stderr and "0 bytes stack frame" in out.stderr, out.stderr[-800:]
    assert ("wgmma.mma_async instructions are serialized" in out.stderr) == serialized, out.stderr[-800:]
    # ptxas also waits for a wgmma itself where its accumulators are read before the kernel waits (C7517); in
    # the main loop that would undo any overlap, so each such wait must come before the first loop
    injected = [int(n) for n in re.findall(r"C7517\) warpgroup.wait is injected in around line (\d+)", out.stderr)]
    if injected:
        ptx = subprocess.run(["nvcc", f"-arch={arch}", "-ptx", "-o", "-", str(cu)], capture_output=True, text=True,
                             timeout=300).stdout.splitlines()
        first_loop = next(i + 1 for i, ln in enumerate(ptx) if ln.startswith("$L__BB0_"))
        assert all(n < first_loop for n in injected), (injected, first_loop)
    return out.stderr


_KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(')


def ptxas_logs(sources: list[str], tmp_path, arch: str) -> list[str]:
    """Build each CUDA source of ``sources`` with nvcc for ``arch`` and return ptxas's report (``-Xptxas -v``) of each
    source's kernels, requiring no register spills and no stack frame in any of them.

    Sources of one template share TVM's preamble (the text before the first kernel), whose headers take most of
    nvcc's second a compile: sources with the same preamble are built as one translation unit, each kernel renamed
    with its source's index (ptxas allocates registers per kernel, so each report is the kernel's own)."""
    groups: dict[str, list[int]] = {}
    for i, src in enumerate(sources):
        groups.setdefault(src[:_KERNEL.search(src).start()], []).append(i)
    logs = [""] * len(sources)
    for n, (preamble, members) in enumerate(groups.items()):
        parts = [preamble]
        for i in members:
            body = sources[i][len(preamble):]
            for name in set(_KERNEL.findall(body)):
                body = re.sub(rf"\b{name}\b", f"{name}__s{i}", body)
            parts.append(body)
        cu = tmp_path / f"batch{n}.cu"
        cu.write_text("\n".join(parts))
        out = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", str(cu.with_suffix(".cubin")),
                              str(cu)], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        # ptxas's report, one block per kernel: "Compiling entry function 'k__s3' ... Used N registers ..."
        for block in re.split(r"(?=ptxas info\s+: Compiling entry function)", out.stderr)[1:]:
            i = int(re.search(r"Compiling entry function '\w+__s(\d+)'", block).group(1))
            logs[i] += block
    for i, log in enumerate(logs):
        assert log, f"source {i}: ptxas reported no kernel"
        props = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert props and all(p == ("0", "0", "0") for p in props), f"source {i}: {log[-800:]}"
    return logs


def commit_record(db_path, target, kernel, trace, secs: float = 1e-3) -> None:
    """Store ``trace`` as a tuning record of ``kernel`` (a workload) in the tvmfuse database at ``db_path``."""
    from tvmfuse.db import open_database

    db = open_database(db_path, target=target)
    try:
        workload = db.ms_database.commit_workload(kernel.mod)
        db.ms_database.commit_tuning_record(ms.database.TuningRecord(
            trace, workload, [secs], target.target, ms.arg_info.ArgInfo.from_prim_func(kernel.mod["main"])))
    finally:
        db.close()


def build_with_record(db_path, target, fused, kernel, trace):
    """``compile``'s build of ``fused`` with ``trace`` stored as ``kernel``'s only tuning record."""
    from tvmfuse.compile.build import build
    from tvmfuse.db import open_database

    commit_record(db_path, target, kernel, trace)
    db = open_database(db_path, target=target)
    try:
        return build(fused, target=target, database=db)
    finally:
        db.close()


def _py(node) -> str:
    """A TIR expression's TVMScript AST as the Python that :func:`_at_every_value` evaluates."""
    import ast

    return ast.unparse(node).replace("T.min(", "minimum(").replace("T.max(", "maximum(")


def _at_every_value(expr: str, ranges: dict):
    """The integer expression ``expr`` (Python syntax) at every combination of its variables' ``ranges``, as one
    broadcast array (a variable per axis)."""
    import numpy as np

    names = sorted(set(re.findall(r"\b[A-Za-z_]\w*\b", expr)) - {"minimum", "maximum"})
    env = {n: np.arange(ranges[n].start, ranges[n].stop).reshape([-1 if j == k else 1 for j in range(len(names))])
           for k, n in enumerate(names)}
    return np.asarray(eval(expr, {"minimum": np.minimum, "maximum": np.maximum}, env))


def assert_shared_offsets_aligned(func) -> int:
    """Every ``cp.async`` destination (raw or zero-filling) and every wgmma descriptor's start in a shared buffer of
    the TIR ``func`` is a whole 16 bytes (8 fp16) from the buffer's start and leaves 16 bytes inside it, at every
    value of every loop around it (each offset evaluated over all its loop variables at once). A misaligned
    address only shows on the GPU, as an illegal access that kills the process's CUDA context. Returns how many
    sites it checked."""
    import ast

    import numpy as np

    sizes, sites = {}, []

    def visit(node, ranges: dict) -> None:   # ranges: the loops around ``node`` (a name may be reused)
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) in ("T.alloc_buffer", "T.alloc_shared")
                and "shared" in ast.unparse(node.value)):
            sizes[node.targets[0].id] = int(np.prod(ast.literal_eval(node.value.args[0])))
        elif isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Call):
            args = [ast.literal_eval(a) for a in node.iter.args if isinstance(a, ast.Constant)]
            if args:
                loop = range(*args[:2]) if len(args) >= 2 else range(args[0])
            else:   # an extent of the loops around it (a causal tile's key steps): its largest value bounds it
                loop = range(int(_at_every_value(_py(node.iter.args[-1]), ranges).max()))
            ranges = {**ranges, node.target.id: loop}
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "T.s_tir.cp_async_raw":
            sites.append((ast.unparse(node.args[1]).removesuffix(".data"), node.args[2], ranges))
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) == "T.address_of"
              and isinstance(node.args[0], ast.Subscript)):
            sites.append((ast.unparse(node.args[0].value), node.args[0].slice, ranges))
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) == "T.cuda.func_call"
              and ast.literal_eval(node.args[0]) == "tvmfuse_cp_async_zfill"):
            # (the GEMM template's branch-free zero-filling copy: dst = sa_base + T.Cast("uint32", (offset) * 2))
            dst = node.args[1]
            sites.append((dst.left.id.removesuffix("_base"), dst.right.args[1].left, ranges))
        inner = dict(ranges)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)
            if (isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name) and child.value is not None
                    and "T." not in _py(child.value)):
                # a let of plain arithmetic of the loops (a causal kernel's reversed tile index): its values reach
                # the statements after it (a let of anything else is no address this check follows)
                try:
                    vals = _at_every_value(_py(child.value), inner)
                except KeyError:
                    continue
                inner[child.target.id] = range(int(vals.min()), int(vals.max()) + 1)

    visit(ast.parse(func.script()), {})
    checked = 0
    for buf, expr, ranges in sites:
        if buf not in sizes:
            continue
        vals = _at_every_value(_py(expr), ranges)
        text = f"{buf}[{ast.unparse(expr)}]"
        assert (vals % 8 == 0).all(), f"not 16-byte aligned: {text}"
        assert (vals >= 0).all() and (vals + 8 <= sizes[buf]).all(), f"out of bounds: {text}"
        checked += 1
    return checked


_VECTOR_BYTES = {"uint4": 16, "int4": 16, "float4": 16, "uint2": 8, "int2": 8, "float2": 8, "half4": 8,
                 "half2": 4, "uint1": 4, "int1": 4, "float1": 4}
_ELEMENT_BYTES = {"half": 2, "float": 4, "int": 4, "uint": 4, "signed char": 1, "char": 1, "double": 8}


def _cuda_index_env(src: str):
    """``(ranges, python)`` for evaluating index expressions of the generated CUDA ``src``: the thread, block and
    loop variables' ranges (the block index over its first 64 values), and a function that turns a CUDA index
    expression into Python over those names (cse variables inlined, ``/`` as ``//``, ``min`` elementwise)."""
    bounds = re.search(r"__launch_bounds__\((\d+)\)", src)
    ranges = {"tx": range(int(bounds.group(1)) if bounds else 1024), "ty": range(8), "bx": range(64),
              "by": range(8)}
    ranges.update({m.group(1): range(int(m.group(2)))
                   for m in re.finditer(r"for \(int (\w+) = 0; \1 < (\d+); \+\+\1\)", src)})
    defs = dict(re.findall(r"int (cse_v\d+) = (.+);", src))

    def python(expr: str) -> str:
        for _ in range(8):   # cse variables may use each other
            expr = re.sub(r"\bcse_v\d+\b", lambda m: f"({defs[m.group(0)]})", expr)
        expr = (expr.replace("((int)threadIdx.x)", "tx").replace("((int)threadIdx.y)", "ty")
                .replace("((int)blockIdx.x)", "bx").replace("((int)blockIdx.y)", "by"))
        expr = re.sub(r"\bmin\(", "minimum(", expr)
        return re.sub(r"(?<![/])/(?![/])", "//", expr)

    return ranges, python


def _call_args(src: str, start: int) -> list[str]:
    """The top-level comma-separated arguments of the call whose opening parenthesis is at ``src[start - 1]``."""
    args, depth, i, begin = [], 1, start, start
    while depth:
        c = src[i]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        if (c == "," and depth == 1) or depth == 0:
            args.append(src[begin:i].strip())
            begin = i + 1
        i += 1
    return args


def _guarded_ranges(src: str, ranges: dict) -> list[dict]:
    """Per line of the generated CUDA ``src``: ``ranges`` narrowed by the enclosing ``if (var < N) {`` guards
    (TVM's simplifier rewrites an index under such a guard using it, e.g. a slot ``(j + 1) % 2`` as ``j + 1``)."""
    out, stack, current = [], [], dict(ranges)
    for line in src.splitlines():
        out.append(current)
        for _ in range(line.count("}")):
            current = stack.pop() if stack else dict(ranges)
        if line.rstrip().endswith("{"):
            stack.append(current)
            guard = re.fullmatch(r"\s*if \((\w+) < (\d+)\) \{", line)
            if guard and guard.group(1) in current:
                var = current[guard.group(1)]
                current = {**current, guard.group(1): range(var.start, min(var.stop, int(guard.group(2))))}
    return out


def assert_copy_sources_disjoint(src: str) -> int:
    """The 16-byte shared-memory chunks that the ``cp.async`` copies of the generated CUDA ``src`` write (raw and
    zero-filling) are disjoint between global sources: no chunk filled from A is ever filled from B, at any thread,
    block or loop value. TVM's shared-memory planner may lay one tile buffer over another when it sees no use of
    the first past some point; the kernel then reads B's data as A's (2026-11-30: wrong results on the H200 at 3
    stages with a batch in flight). Returns how many copies it checked."""
    import numpy as np

    ranges, python = _cuda_index_env(src)
    guarded = _guarded_ranges(src, ranges)
    chunks: dict[str, set] = {}
    checked = 0
    for m in re.finditer(r"(ptx_cp_async_legacy_cg_16_2_2|tvmfuse_cp_async_zfill)\(", src):
        if src[m.start() - 1] == " " and src[m.start() - 5:m.start()] == "void ":
            continue   # the helper's definition
        args = _call_args(src, m.end())
        if m.group(1) == "tvmfuse_cp_async_zfill":   # (base + (uint)(byte offset)), source, ...
            inner = re.fullmatch(r"\(\w+\[0\] \+ \(\(uint\)(.*)\)\)", args[0], re.S)
            expr, source, per_chunk = inner.group(1), args[1], 16
        else:                                         # shared, element offset, source, ...
            expr, source, per_chunk = args[1], args[2], 8
        offsets = _at_every_value(python(expr), guarded[src.count("\n", 0, m.start())])
        chunks.setdefault(source, set()).update(np.unique(offsets // per_chunk).tolist())
        checked += 1
    sources = sorted(chunks)
    for i, a in enumerate(sources):
        for b in sources[i + 1:]:
            both = chunks[a] & chunks[b]
            assert not both, f"copies from {a} and {b} fill the same shared chunks ({len(both)}, e.g. {min(both)})"
    return checked


def assert_shared_vectors_aligned(src: str) -> int:
    """Every vector load or store into a ``__shared__`` array of the generated CUDA ``src``
    (``*(uint4*)(x_shared_ptr + i)``) starts at a multiple of its width, at every thread, block and loop value.
    Each index is evaluated over all of them (the block index over its first 64 values); a misaligned vector
    access only shows on the GPU, where it kills the runner (2026-11-30: every 16-byte candidate of the tiled
    transpose, whose rows are padded to an odd number of words). Returns how many accesses it checked."""
    shared = {m.group(2): _ELEMENT_BYTES[m.group(1)]
              for m in re.finditer(r"__shared__ alignas\(\d+\) ([a-z ]+?) (\w+)\[\d+\];", src)}
    ranges, python = _cuda_index_env(src)

    checked = 0
    for m in re.finditer(r"\*\((\w+)\*\)\((\w+) \+ ", src):
        vec, buf = m.groups()
        if buf not in shared or vec not in _VECTOR_BYTES:
            continue
        depth, i = 1, m.end()   # the index: up to the parenthesis that closes "(buf + "
        while depth:
            depth += {"(": 1, ")": -1}.get(src[i], 0)
            i += 1
        expr = python(src[m.end():i - 1])
        index = _at_every_value(expr, ranges)
        lanes = _VECTOR_BYTES[vec] // shared[buf]
        assert (index % lanes == 0).all(), f"{vec} access to {buf} not {_VECTOR_BYTES[vec]}-byte aligned: {expr}"
        checked += 1
    return checked


def cuda_source(exe) -> str:
    """The CUDA source of a built executable (every CUDA module it imports)."""
    from tvmfuse._tvm import cuda_sources

    return "\n".join(cuda_sources(exe))


def copy_bytes(src: str) -> set:
    """Every raw ``cp.async`` of the generated CUDA ``src`` as (global source, shared byte, global byte) at every
    thread, block and loop value: which bytes of A and B land where in shared memory, whatever the element type the
    kernel counts its offsets in (``ptx_cp_async_legacy_cg_16_D_S``: D-byte shared and S-byte global elements)."""
    import numpy as np

    ranges, python = _cuda_index_env(src)
    guarded = _guarded_ranges(src, ranges)
    out = set()
    for m in re.finditer(r"ptx_cp_async_legacy_cg_16_(\d)_(\d)\(", src):
        if src[m.start() - 5:m.start()] == "void ":
            continue   # the helper's definition
        args = _call_args(src, m.end())
        here = guarded[src.count("\n", 0, m.start())]
        exprs = [python(args[1]), python(args[3])]
        names = sorted(set(re.findall(r"\b[A-Za-z_]\w*\b", " ".join(exprs))) - {"minimum", "maximum"})
        env = {n: np.arange(here[n].start, here[n].stop).reshape([-1 if j == k else 1 for j in range(len(names))])
               for k, n in enumerate(names)}
        shared, glob = np.broadcast_arrays(*(np.asarray(eval(e, {"minimum": np.minimum, "maximum": np.maximum}, env))
                                             for e in exprs))
        out.update(zip([args[2]] * shared.size, (shared.ravel() * int(m.group(1))).tolist(),
                       (glob.ravel() * int(m.group(2))).tolist()))
    return out


def thread_chunks(src: str, calls: str) -> set:
    """(thread, shared byte) of every 16-byte chunk that the calls matching the regex ``calls`` of the generated CUDA
    ``src`` touch, at every thread and loop value: a raw ``cp.async``'s destination (its shared element index times
    its element size) or a helper's shared address (``smem_base_ptr[0] + ((uint)(bytes))``, its first argument)."""
    import numpy as np

    ranges, python = _cuda_index_env(src)
    guarded, conditions = _guarded_ranges(src, ranges), _conditions(src)
    out = set()
    for m in re.finditer(rf"({calls})\(", src):
        if src[m.start() - 5:m.start()] == "void ":
            continue   # a helper's definition
        args = _call_args(src, m.end())
        raw = re.match(r"ptx_cp_async_legacy_cg_16_(\d)_\d$", m.group(1))
        if raw:
            expr, scale = python(args[1]), int(raw.group(1))
        else:
            expr, scale = python(re.fullmatch(r"\(smem_base_ptr\[0\] \+ \(\(uint\)(.+)\)\)", args[0]).group(1)), 1
        line = src.count("\n", 0, m.start())
        here, guards = guarded[line], [(python(c), negated) for c, negated in conditions[line]]
        names = sorted(set(re.findall(r"\b[A-Za-z_]\w*\b", " ".join([expr, *(c for c, _ in guards)])))
                       - {"minimum", "maximum"} | {"tx"})
        env = {n: np.arange(here[n].start, here[n].stop).reshape([-1 if j == k else 1 for j in range(len(names))])
               for k, n in enumerate(names)}
        funcs = {"minimum": np.minimum, "maximum": np.maximum}
        runs = np.ones((), bool)
        for cond, negated in guards:   # (the threads and steps that reach the call)
            holds = np.asarray(eval(cond, funcs, env), bool)
            runs = runs & (~holds if negated else holds)
        at, tx, runs = np.broadcast_arrays(np.asarray(eval(expr, funcs, env)), env["tx"], runs)
        out.update(zip(tx[runs].tolist(), (at[runs] * scale).tolist()))
    return out


def _conditions(src: str) -> list[list]:
    """Per line of the generated CUDA ``src``: the enclosing ``if (cond) {`` conditions, each with whether the line
    is in its ``else`` branch (the conditions as C text: ``&&``, ``||`` and ``!`` as numpy's ``&``, ``|``, ``~``)."""
    out, stack = [], []
    for line in src.splitlines():
        out.append([c for c in stack if c is not None])
        stripped = line.strip()
        if stripped == "} else {":
            cond = stack.pop()
            stack.append(None if cond is None else (cond[0], True))
            continue
        for _ in range(stripped.count("}")):
            if stack:
                stack.pop()
        if stripped.endswith("{"):
            m = re.fullmatch(r"if \((.+)\) \{", stripped)
            cond = None if m is None else m.group(1).replace("&&", "&").replace("||", "|")
            cond = None if cond is None or "!" in cond.replace("!=", "") else cond
            stack.append(None if cond is None else (cond, False))
    return out


def kernel_text(src: str) -> list[str]:
    """The kernel of the generated CUDA ``src`` as lines, for comparing two kernels' structure: the device helpers
    before it dropped, ``cse`` variables inlined, pointer types and the wgmma and raw ``cp.async`` helpers' names
    (their instruction and element types) made one."""
    body = src[src.index('extern "C" __global__'):]
    defs = dict(re.findall(r"int (cse_v\d+) = (.+);", body))
    lines = []
    for line in body.splitlines():
        if re.match(r"\s*int cse_v\d+ = ", line):
            continue
        for _ in range(8):
            line = re.sub(r"\bcse_v\d+\b", lambda m: f"({defs[m.group(0)]})", line)
        line = re.sub(r"\b(half|float)\* __restrict__", "T* __restrict__", line)
        line = re.sub(r"tvm_builtin_ptx_wgmma_\w+_mma_async_\w+\(", "wgmma(", line)
        lines.append(re.sub(r"ptx_cp_async_legacy_cg_16_\d_\d\(.*", "cp_async(...)", line))
    return lines


def twin_and_kernel_outputs(twin, func, seed: int = 0):
    """The outputs (float32) of two PrimFuncs of one signature, the last parameter the output, built for the CPU
    (:data:`EMULATE`) and run on the same random inputs, the output filled with NaN first: a template's scalar
    twin against the planner's function it stands for."""
    import numpy as np

    bufs = [func.buffer_map[p] if hasattr(func, "buffer_map") else p for p in func.params]
    rng = np.random.default_rng(seed)
    inputs = [(rng.standard_normal([int(d) for d in b.shape]) * 0.5).astype(str(b.dtype)) for b in bufs]
    outs = []
    for f in (twin, func):
        lib = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target=EMULATE)
        args = [tvm.runtime.tensor(a.copy()) for a in inputs]
        args[-1] = tvm.runtime.tensor(np.full(inputs[-1].shape, np.nan, inputs[-1].dtype))
        lib["main"](*args)
        outs.append(args[-1].numpy().astype("float32"))
    return outs


def wgmma_source(spec, cfg, dtype: str) -> str:
    """The CUDA source (sm_90a) of the wgmma template's kernel of ``spec`` at ``cfg``: A and B (``[N, K]``) of
    ``dtype`` (a conv's input NHWC), C fp32."""
    from tvmfuse.kernels import wgmma as hopper

    h = spec.halves()
    a_shape = ((h.conv.n, h.conv.h, h.conv.w, h.conv.c // (2 if dtype == "float32" else 1)) if spec.conv
               else (spec.rows, spec.k))
    decls = [f"a: T.Buffer({a_shape}, '{dtype}')", f"b: T.Buffer(({spec.n}, {spec.k}), '{dtype}')",
             f"c: T.Buffer(({spec.rows}, {spec.n}), 'float32')"]
    func = hopper.parse(hopper.gemm_source(spec, cfg, decls, "a", "b", "c[{row}, {col}] = {acc}"))
    sm90a = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    return tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=sm90a) \
        .mod.imports[0].inspect_source()
