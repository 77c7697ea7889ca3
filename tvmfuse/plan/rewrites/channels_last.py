"""2-D convolutions run channels-last (NHWC activations; OHWI filters on GPUs, HWIO on CPUs)."""
from __future__ import annotations

import numpy as np

from tvmfuse._tvm import RelaxConstant, const_numpy, relax, tvm
from tvmfuse.plan.rewrites._common import count_calls, main_bindings, module_pass, op_name, rebuild_main
from tvmfuse.plan.rewrites.channel_shuffle import shuffle_channels_last
from tvmfuse.plan.rewrites.compose_transposes import compose_transposes
from tvmfuse.plan.tags import RewriteLog


def channels_last(mod, *, log: RewriteLog, kernel_layout: str = "OHWI", conv1d_kernel_layout: str | None = None,
                  depthwise_kernel_layout: str | None = None):
    """Run 2-D convolutions in NHWC with ``kernel_layout`` weights (OHWI: the tensor-core template reads K
    contiguously; HWIO: a CPU kernel vectorised along the output channels reads them contiguously) (Relax's
    ConvertLayout), then fold the weight and parameter transposes into the constants. Elementwise ops, pooling and
    the folded BatchNorm follow the layout, so one transpose stays at the input and one where the features leave
    the conv stack. With ``conv1d_kernel_layout`` (WIO on CPUs, OWI on GPUs) 1-D convolutions run NWC too: an NCW
    conv's vector ran along time, half a vector where no whole one divides the frames (Whisper's stem, 3000 frames:
    4 GMAC/s on the 2-core EPYC). ``depthwise_kernel_layout`` (HWIO on GPUs): the filters of depthwise convs (no
    tensor-core template takes them) stored so that threads of adjacent output channels read adjacent weights
    (:func:`depthwise_filters`)."""
    wanted = {"relax.nn.conv2d": ["NHWC", kernel_layout]}
    if conv1d_kernel_layout:
        wanted["relax.nn.conv1d"] = ["NWC", conv1d_kernel_layout]
    layouts = {op: layout for op, layout in wanted.items() if count_calls(mod, op)}
    if not layouts:
        return mod
    before = count_calls(mod, "relax.permute_dims")
    mod = tvm.transform.Sequential([
        relax.transform.ConvertLayout(layouts),
        relax.transform.FoldConstant(),
    ])(mod)
    added = count_calls(mod, "relax.permute_dims") - before
    mod, cancelled = compose_transposes(mod)
    mod, shuffles = shuffle_channels_last(mod)
    depthwise = 0
    if depthwise_kernel_layout == "HWIO" and kernel_layout == "OHWI":
        mod, depthwise = depthwise_filters(mod)
    names = " / ".join(layout for layout, _ in layouts.values())
    log.notes.append(f"convolutions run channels-last ({names}): {added} layout transposes added at the edges"
                     + (f"; {cancelled} transposes that undid each other removed" if cancelled else "")
                     + (f"; {shuffles} channel shuffles, splits, concatenations and scalar elementwise ops moved past "
                        "their layout transposes" if shuffles else "")
                     + (f"; {depthwise} depthwise convs' filters HWIO" if depthwise else ""))
    return mod


def depthwise_filters(mod, most_taps: int = 64) -> tuple:
    """(``mod``, how many) with the constant OHWI filters of depthwise NHWC convs (one input channel a group, at
    most ``most_taps`` taps) stored HWIO. Such a conv runs one to four adjacent output channels a thread
    (``ShortReduction``), adjacent threads on adjacent channels: an OHWI filter put their weights of one tap ``r * s`` elements apart (a 5 x 5
    conv: 50 bytes, a sector a thread), HWIO puts them side by side (EfficientNet-B0's 32 x 14 x 14 x 672 5 x 5 conv
    took 74 us on an H100 with OHWI, for 17 MB; the model 1.555 ms, 1.335 with HWIO). Grouped convs of wider groups
    keep OHWI: a reduction spread over a block's threads reads a filter along (r, s, c), OHWI's contiguous axis."""
    bindings = main_bindings(mod)
    if bindings is None:
        return mod, 0
    plan = {}
    for b in bindings:
        call = b.value
        if op_name(call) != "relax.nn.conv2d" or not isinstance(call.args[1], RelaxConstant):
            continue
        at = call.attrs
        if int(at.groups) == 1 or (str(at.data_layout), str(at.kernel_layout)) != ("NHWC", "OHWI"):
            continue
        w = const_numpy(call.args[1])
        if w.shape[3] != 1 or w.shape[1] * w.shape[2] > most_taps:
            continue
        w = np.ascontiguousarray(w.transpose(1, 2, 3, 0))

        def emit(bb, vmap, call=call, w=w, at=at):
            x = vmap.get(call.args[0], call.args[0])
            return relax.op.nn.conv2d(x, relax.const(w), strides=at.strides, padding=at.padding,
                                      dilation=at.dilation, groups=int(at.groups), data_layout="NHWC",
                                      kernel_layout="HWIO", out_layout=str(at.out_layout), out_dtype=at.out_dtype)
        plan[b.var] = emit
    return (rebuild_main(mod, plan, set()) if plan else mod), len(plan)


def ChannelsLast(*, log: RewriteLog, kernel_layout: str = "OHWI", conv1d_kernel_layout: str | None = None,
                 depthwise_kernel_layout: str | None = None) -> tvm.transform.Pass:
    """:func:`channels_last` as a Relax module pass."""
    return module_pass("ChannelsLast", lambda mod: channels_last(mod, log=log, kernel_layout=kernel_layout,
                                                                 conv1d_kernel_layout=conv1d_kernel_layout,
                                                                 depthwise_kernel_layout=depthwise_kernel_layout))
