"""Channel shuffles run channels-last, and the splits after them split channels-last.

ShuffleNet writes its channel shuffle for NCHW: ``reshape(x, [N, g, C/g, H, W])``, swap the two channel axes,
``reshape`` back, then ``split`` the channels. Once the convs run NHWC (:mod:`channels_last`), every shuffle sat
between two layout transposes: NHWC -> NCHW, the shuffle as a gather, a split, and each half back to NHWC (three
kernels a block; 30 us a shuffle and 12 us a transpose at 14 x 14 x 116 on the 2-core EPYC). The same shuffle on
the NHWC tensor is ``reshape(x, [N, H, W, g, C/g])``, swap the last two axes, ``reshape`` back, with the NCHW
transpose moved after it; a split of a transposed tensor is a split of the tensor along the permuted axis, each
piece transposed; and the transposes that then meet their inverse compose away (:mod:`compose_transposes`).
"""
from __future__ import annotations

from tvmfuse._tvm import RelaxConstant, relax, tvm
from tvmfuse.plan.graph import tensor_shape
from tvmfuse.plan.rewrites._common import CLEAN, main_bindings, op_name, permute_axes, rebuild_main, users_of
from tvmfuse.plan.rewrites.compose_transposes import compose_transposes

_TO_NCHW = [0, 3, 1, 2]
_MOST_ROUNDS = 64   # ShuffleNet-v2 has 16 shuffles; each round reaches one more block


def _shuffles(bindings) -> dict:
    """``{final reshape var: (x, g, (N, H, W, C))}`` for each NCHW shuffle of ``permute_dims(x, [0, 3, 1, 2])``
    into ``g`` groups."""
    defs, users = {b.var: b.value for b in bindings}, users_of(bindings)
    found = {}
    for b in bindings:
        last = b.value
        if op_name(last) != "relax.reshape" or not isinstance(last.args[0], relax.Var):
            continue
        swap = defs.get(last.args[0])
        if op_name(swap) != "relax.permute_dims" or permute_axes(swap) != [0, 2, 1, 3, 4]:
            continue
        split = defs.get(swap.args[0])
        if op_name(split) != "relax.reshape" or not isinstance(split.args[0], relax.Var):
            continue
        to_nchw = defs.get(split.args[0])
        if op_name(to_nchw) != "relax.permute_dims" or permute_axes(to_nchw) != _TO_NCHW:
            continue
        x = to_nchw.args[0]
        nhwc, grouped, out = tensor_shape(x.ty), tensor_shape(swap.args[0].ty), tensor_shape(b.var.ty)
        if nhwc is None or grouped is None or out is None or len(nhwc) != 4 or len(grouped) != 5:
            continue
        n, h, w, c = (int(d) for d in nhwc)
        g = int(grouped[1])
        if [int(d) for d in grouped] != [n, g, c // g, h, w] or [int(d) for d in out] != [n, c, h, w] \
                or len(users.get(swap.args[0], [])) != 1 or len(users.get(last.args[0], [])) != 1:
            continue
        found[b.var] = (x, g, (n, h, w, c))
    return found


def _transposed_splits(bindings) -> tuple[dict, dict]:
    """Splits of ``permute_dims(s, p)`` read only through their pieces: ``{split var: (s, p)}`` and, for each
    piece, ``{piece var: (split var, index, p)}``."""
    defs, users = {b.var: b.value for b in bindings}, users_of(bindings)
    splits, pieces = {}, {}
    for b in bindings:
        if op_name(b.value) != "relax.split" or not isinstance(b.value.args[0], relax.Var):
            continue
        t = b.value.args[0]
        inner = defs.get(t)
        if op_name(inner) != "relax.permute_dims" or len(users.get(t, [])) != 1:
            continue
        readers = users.get(b.var, [])
        if not readers or not all(isinstance(r.value, relax.TupleGetItem) for r in readers):
            continue
        splits[b.var] = (inner.args[0], permute_axes(inner))
        for r in readers:
            pieces[r.var] = (b.var, int(r.value.index), permute_axes(inner))
    return splits, pieces


def _transposed_concats(bindings) -> dict:
    """``{concat var: (inputs, p)}`` for concatenations of tensors all transposed by one ``p`` and read nowhere
    else (the next ShuffleNet block concatenates its kept half with its branch, both transposed to NCHW)."""
    defs, users = {b.var: b.value for b in bindings}, users_of(bindings)
    found = {}
    for b in bindings:
        if op_name(b.value) != "relax.concat" or not isinstance(b.value.args[0], relax.Tuple):
            continue
        parts = list(b.value.args[0].fields)
        inner = [defs.get(v) if isinstance(v, relax.Var) else None for v in parts]
        if not inner or any(op_name(i) != "relax.permute_dims" for i in inner):
            continue
        axes = permute_axes(inner[0])
        if any(permute_axes(i) != axes for i in inner) or any(len(users.get(v, [])) != 1 for v in parts):
            continue
        found[b.var] = ([i.args[0] for i in inner], axes, int(b.value.attrs.axis))
    return found


# elementwise ops that commute with a transpose when their other operands are scalars
_ELEMENTWISE = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.round", "relax.minimum",
                "relax.maximum", "relax.astype", "relax.clip", "relax.nn.relu"}


def _is_scalar(e) -> bool:
    shape = tensor_shape(e.ty) if isinstance(e, RelaxConstant) else None
    return shape is not None and all(int(d) == 1 for d in shape)


def _transposed_elementwise(bindings) -> dict:
    """``{var: (x, call)}`` for an elementwise ``call`` (its other operands scalar constants) of ``permute_dims(x,
    [0, 3, 1, 2])`` read nowhere else. A quantized graph's QuantizeLinear, as its arithmetic, sits between a
    channels-last concatenation and the transpose to NCHW that ConvertLayout put before the shuffle's reshape;
    moved past it, the transpose meets the shuffle."""
    defs, users = {b.var: b.value for b in bindings}, users_of(bindings)
    found = {}
    for b in bindings:
        call = b.value
        if op_name(call) not in _ELEMENTWISE or not call.args or not isinstance(call.args[0], relax.Var):
            continue
        inner = defs.get(call.args[0])
        if op_name(inner) != "relax.permute_dims" or permute_axes(inner) != _TO_NCHW \
                or len(users.get(call.args[0], [])) != 1 or not all(_is_scalar(a) for a in call.args[1:]):
            continue
        found[b.var] = (inner.args[0], call)
    return found


def _sink_once(mod) -> "tuple[tvm.IRModule, int]":
    """One round: shuffles rewritten channels-last, then splits and concatenations moved before the transposes
    around them; returns the module and how many sites changed."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod, 0
    changed = 0
    plan = {}
    for var, (parts, axes, axis) in _transposed_concats(bindings).items():
        def concat(bb, vmap, parts=parts, axes=axes, axis=axis):
            joined = bb.emit(relax.op.concat([vmap.get(v, v) for v in parts], axis=axes[axis]))
            return relax.op.permute_dims(joined, axes)

        plan[var] = concat
    for var, (x, call) in _transposed_elementwise(bindings).items():
        def elementwise(bb, vmap, x=x, call=call):
            moved = bb.emit(relax.Call(call.op, [vmap.get(x, x), *call.args[1:]], call.attrs))
            return relax.op.permute_dims(moved, _TO_NCHW)

        plan[var] = elementwise
    if plan:
        changed += len(plan)
        mod = tvm.transform.Sequential(CLEAN)(rebuild_main(mod, plan, set()))
    mod, shuffled = _shuffle_once(mod)
    return mod, changed + shuffled


def shuffle_channels_last(mod) -> "tuple[tvm.IRModule, int]":
    """Move the layout transposes around channel shuffles out of the way until nothing changes (each round
    exposes the next block's shuffle); returns the module and the number of shuffles rewritten."""
    total = 0
    for _ in range(_MOST_ROUNDS):
        mod, changed = _sink_once(mod)
        if not changed:
            break
        mod, _ = compose_transposes(mod)
        total += changed
    return mod, total


def _shuffle_once(mod) -> "tuple[tvm.IRModule, int]":
    """Rewrite each NCHW channel shuffle of an NHWC tensor into its NHWC form, and split transposed tensors
    before their transpose; returns the module and the number of sites changed."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod, 0
    shuffles = _shuffles(bindings)
    plan = {}
    for var, (x, g, (n, h, w, c)) in shuffles.items():
        def emit(bb, vmap, x=x, g=g, n=n, h=h, w=w, c=c):
            grouped = bb.emit(relax.op.reshape(vmap.get(x, x), [n, h, w, g, c // g]))
            swapped = bb.emit(relax.op.permute_dims(grouped, [0, 1, 2, 4, 3]))
            shuffled = bb.emit(relax.op.reshape(swapped, [n, h, w, c]))
            return relax.op.permute_dims(shuffled, _TO_NCHW)

        plan[var] = emit
    if plan:
        mod = tvm.transform.Sequential(CLEAN)(rebuild_main(mod, plan, set()))
        bindings = main_bindings(mod)
    splits, pieces = _transposed_splits(bindings)
    plan = {}
    for var, (s, axes) in splits.items():
        call = next(b.value for b in bindings if b.var.same_as(var))

        def split(bb, vmap, s=s, axes=axes, call=call):
            return relax.op.split(vmap.get(s, s), call.attrs.indices_or_sections, axis=axes[int(call.attrs.axis)])

        plan[var] = split
    for var, (split_var, index, axes) in pieces.items():
        def piece(bb, vmap, split_var=split_var, index=index, axes=axes):
            item = bb.emit(relax.TupleGetItem(vmap[split_var], index))
            return relax.op.permute_dims(item, axes)

        plan[var] = piece
    if plan:
        mod = tvm.transform.Sequential(CLEAN)(rebuild_main(mod, plan, set()))
    return mod, len(shuffles) + len(splits)
