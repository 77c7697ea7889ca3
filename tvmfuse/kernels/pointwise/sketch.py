"""The pointwise template's sketches: an injective chain inlined, fused and split into vectors, threads and
blocks (one-shot or grid-stride); a transpose of the innermost axis also gets a tile through shared memory."""
from __future__ import annotations

from tvmfuse._tvm import structural_equal
from tvmfuse.kernels.knobs import Knob, sample
from tvmfuse.kernels.sketch import inline_all_but_outputs
from tvmfuse.kernels.pointwise.transpose import transpose_sketch, transposed_input
from tvmfuse.kernels.staging import dtype_bytes, flat_map, stage_through_registers, vector_knob


def same_index_reads(sch, block) -> list[str]:
    """The inputs ``block`` reads at exactly the element it writes: those go through registers as vectors.

    Broadcast ones (a bias row) are read in place: a register cache of them is addressed modulo the row, which TVM
    cannot compact to the thread's share. So are inputs read at shifted elements (a rotary embedding's rotate-half,
    ``x[..., d + D/2]`` and ``x[..., d - D/2]`` of a tensor of the output's shape): their cache's region was the whole
    tensor, a thread's local array of 262144 floats for LLaMA at 8 x 512 tokens, which the launch refused
    (CUDA_ERROR_INVALID_VALUE) and which at smaller sizes spilled to local memory."""
    stmt = sch.get(block)
    out = stmt.writes[0]
    shape = [int(d) for d in out.source.shape]
    # the shape too: a concatenation reads its first part at the written index, but its cache's region then runs
    # past that input's end (loops of dynamic extent, which the space's postprocessors reject)
    return [str(r.source.name) for r in stmt.reads
            if [int(d) for d in r.source.shape] == shape
            and all(structural_equal(a.min, b.min) and structural_equal(a.extent, b.extent)
                    for a, b in zip(r.region, out.region))]


def template_pointwise(sch, space, info: dict) -> list:
    """Injective kernels: inline the chain, fuse, split [rows, vectors_per_thread, threads, lanes]."""
    inline_all_but_outputs(sch)
    root = sch.get_sblock("root")
    outs = sch.get_output_blocks(root)
    if len(outs) != 1 or len(sch.get_child_blocks(root)) != 1:
        raise ValueError("pointwise template: needs one fused block")
    block = outs[0]
    buf = sch.get(block).writes[0].source
    shape = [int(d) for d in buf.shape]
    total, inner = 1, shape[-1]
    for d in shape:
        total *= d
    ebytes = dtype_bytes(buf.dtype)
    vec_k = vector_knob(space.knobs["vector_lanes"], inner, ebytes)
    b = sch.get(block)
    if any(str(r.source.dtype) == "bool" for r in list(b.reads) + list(b.writes)):
        # TVM's CUDA codegen has no vector of bools (DeBERTa's mask, "Cannot convert type T.boolx8")
        vec_k = Knob("vector_lanes", (1,), (1.0,))
    thr_k = space.knobs["threads"].filtered(lambda t: int(t) <= max(32, total))
    per_k = space.knobs["vectors_per_thread"]
    staged = same_index_reads(sch, block)
    sketches = []
    transpose = transposed_input(sch, block, shape)
    modes = space.knobs.get("loop", Knob("loop", ("one-shot",), (1.0,))).values
    if transpose is not None:
        # the flat sketches ran the conv case's transpose at 16-25% of the copy ceiling on the H200 (the tiled one
        # at 96%): one flat sketch stays beside the tiled one, so that half the search goes to it
        modes = modes[:1]
    for mode in modes:
        s = sch.copy()
        blk = s.get_sblock(s.get(block).name_hint)
        if len(shape) > 1 and [int(iv.dom.extent) for iv in s.get(blk).iter_vars] == shape:
            # one flat iterator: the register caches are then indexed by it directly (see flatten_copy)
            s.transform_block_layout(blk, flat_map(shape))
        loops = s.get_loops(blk)
        fused = s.fuse(*loops) if len(loops) > 1 else loops[0]
        vec = sample(s, vec_k)
        outer, lanes = s.split(fused, [None, vec])
        threads = sample(s, thr_k)
        if mode == "grid-stride":
            # grid = waves x SMs blocks; each thread strides over the whole tensor
            sms = int(info["sm_count"])   # the target's GPU (kernels.space.sketch_info)
            wk = space.knobs["grid_stride_waves"]
            blocks = sample(s, Knob("grid_blocks", tuple(int(w) * sms for w in wk.values), wk.probs))
            it_bx, tx = s.split(outer, [None, threads])
            it, bx = s.split(it_bx, [None, blocks])
            s.reorder(bx, tx, it, lanes)
            s.bind(bx, "blockIdx.x")
            s.bind(tx, "threadIdx.x")
        else:
            per = sample(s, per_k)
            bx, p, tx = s.split(outer, [None, per, threads])
            s.reorder(bx, tx, p, lanes)
            s.bind(bx, "blockIdx.x")
            s.bind(tx, "threadIdx.x")
            it = p
        stage_through_registers(s, blk, it, lanes, reads=staged)
        if "unroll" in space.knobs:
            s.annotate(s.get_sblock("root"), "meta_schedule.unroll_explicit", sample(s, space.knobs["unroll"]))
        sketches.append(s)
    if transpose is not None:
        sketches.append(transpose_sketch(sch.copy(), sch.get(block).name_hint, transpose, space, shape, ebytes))
    return sketches
