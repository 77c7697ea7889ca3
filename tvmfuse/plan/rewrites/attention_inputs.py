"""What FuseAttention recognises in the attention's inputs so the kernel need not read them as tensors: a constant
causal mask (the kernel skips the keys it hides) and K/V heads repeated for grouped-query attention (the kernel
reads each K/V head for its group of query heads)."""
from __future__ import annotations

import numpy as np

from tvmfuse._tvm import RelaxConstant, const_numpy, relax
from tvmfuse.plan.graph import tensor_shape
from tvmfuse.plan.rewrites._common import op_name

# A masked logit must vanish in fp32's exp against any real score: exp(-1e4 + s - max) is 0 for |s| < ~9.9e3. BERT's
# -10000, fp16's lowest (-65504), fp32's lowest (-3.4e38, what torch exports) and -inf all pass.
MASKED_AT_MOST = -1e4


def causal_offset(mask, seq_q: int, seq_k: int, mask_scale: float = 1.0) -> tuple[int | None, str | None]:
    """``(offset, None)`` when ``mask`` (a Relax constant added to the scores) is a causal mask: 0 where key
    ``j <= i + offset`` for query ``i``, at most :data:`MASKED_AT_MOST` (``-inf`` included) elsewhere, in every
    slice of its leading dims; else ``(None, why)`` (``why`` None where it is not triangular at all, so nothing is
    worth reporting). ``mask_scale``: the factor applied to the mask after it is added (mask then scale)."""
    if not isinstance(mask, RelaxConstant):
        return None, None
    arr = np.asarray(const_numpy(mask), dtype=np.float64)
    if arr.ndim < 2 or arr.shape[-2:] != (seq_q, seq_k):
        return None, None   # a padding mask ([.., 1, seq_k]) or a per-row one: read as a tensor
    rows = arr.reshape(-1, seq_q, seq_k)
    zero = rows == 0
    if not zero.any():
        return None, None
    if not zero[0, 0, 0]:
        return None, "the first query row sees no key (a negative causal offset): the mask is kept as a tensor"
    # the offset from the first row's run of visible keys; the whole constant is then checked against it
    offset = (int(np.argmin(zero[0, 0])) if not zero[0, 0].all() else seq_k) - 1
    if zero.all():
        return None, None   # nothing is masked
    keep = np.arange(seq_k)[None, :] <= np.arange(seq_q)[:, None] + offset
    bad = (~zero & keep[None]) | ((rows * mask_scale > MASKED_AT_MOST) & ~keep[None])
    if bad.any():
        s, i, j = (int(x) for x in np.argwhere(bad)[0])
        return None, (f"the mask looks causal but element [{i}, {j}]" + (f" of slice {s}" if rows.shape[0] > 1 else "")
                      + f" is {rows[s, i, j]:g}: kept as a tensor")
    return offset, None


def _broadcast_axis(b, src_shape, out_shape) -> bool:
    """``b`` (a binding) broadcasts ``src_shape``'s one size-1 axis (the one after the head axis) to ``out_shape``:
    ``broadcast_to``, or the frontend's ``tile`` kernel (a Tile whose repeats are 1 except on that axis)."""
    op = op_name(b.value)
    if op == "relax.broadcast_to":
        return True
    if op == "relax.call_tir":
        callee = b.value.args[0]
        name = str(getattr(callee, "name_hint", ""))
        return name.startswith("tile") and len(src_shape) == len(out_shape)
    return False


def kv_repeat(var, defs, users):
    """``(source, group, bindings)`` when ``var`` is K or V with its heads repeated as transformers' ``repeat_kv``
    exports it: ``reshape(expand(unsqueeze(x, head_axis + 1)), [.., kv_heads * group, s, d])`` (Expand or Tile),
    so query head ``h`` reads ``x``'s head ``h // group``; else None. ``bindings``: those only this repeat reads.
    (A Tile of the head axis itself repeats the heads in the other order, ``h % kv_heads``: not this, not taken.)"""
    def single(v):
        return isinstance(v, relax.DataflowVar) and len(users.get(v, [])) == 1

    rb = defs.get(var)
    if rb is None or op_name(rb.value) != "relax.reshape":
        return None
    out = tensor_shape(var.ty)
    bb = defs.get(rb.value.args[0])
    if bb is None or out is None or len(out) < 3:
        return None
    wide = tensor_shape(bb.var.ty)
    ax = len(out) - 2          # the repeat axis: right after the head axis (the last batch axis)
    if wide is None or len(wide) != len(out) + 1 or wide[:ax - 1] != out[:ax - 1] or wide[ax + 1:] != out[ax:]:
        return None
    kv_heads, group = wide[ax - 1], wide[ax]
    if kv_heads * group != out[ax - 1] or group < 2:
        return None
    src = bb.value.args[1][0] if op_name(bb.value) == "relax.call_tir" else bb.value.args[0]
    eb = defs.get(src)
    if eb is None or not _broadcast_axis(bb, tensor_shape(src.ty) or (), wide):
        return None
    narrow = tensor_shape(src.ty)
    if narrow != (*wide[:ax], 1, *wide[ax + 1:]):
        return None
    # the size-1 axis is an Unsqueeze (expand_dims) or a Reshape that inserts it
    if op_name(eb.value) == "relax.expand_dims":
        axes = [int(a) for a in eb.value.attrs.axis]
        if axes != [ax]:
            return None
    elif op_name(eb.value) != "relax.reshape":
        return None
    x = eb.value.args[0]
    if tensor_shape(x.ty) != (*wide[:ax], *wide[ax + 1:]):
        return None
    dropped = [b.var for b in (rb, bb, eb) if single(b.var)]
    return x, group, dropped
