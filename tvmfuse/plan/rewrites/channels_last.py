"""2-D convolutions run channels-last (NHWC activations; OHWI filters on GPUs, HWIO on CPUs)."""
from __future__ import annotations

from tvmfuse._tvm import relax, tvm
from tvmfuse.plan.rewrites._common import count_calls, module_pass
from tvmfuse.plan.rewrites.channel_shuffle import shuffle_channels_last
from tvmfuse.plan.rewrites.compose_transposes import compose_transposes
from tvmfuse.plan.tags import RewriteLog


def channels_last(mod, *, log: RewriteLog, kernel_layout: str = "OHWI", conv1d_kernel_layout: str | None = None):
    """Run 2-D convolutions in NHWC with ``kernel_layout`` weights (OHWI: the tensor-core template reads K
    contiguously; HWIO: a CPU kernel vectorised along the output channels reads them contiguously) (Relax's
    ConvertLayout), then fold the weight and parameter transposes into the constants. Elementwise ops, pooling and
    the folded BatchNorm follow the layout, so one transpose stays at the input and one where the features leave
    the conv stack. With ``conv1d_kernel_layout`` (WIO on CPUs) 1-D convolutions run NWC too: an NCW conv's
    vector ran along time, half a vector where no whole one divides the frames (Whisper's stem, 3000 frames:
    4 GMAC/s on the 2-core EPYC)."""
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
    names = " / ".join(layout for layout, _ in layouts.values())
    log.notes.append(f"convolutions run channels-last ({names}): {added} layout transposes added at the edges"
                     + (f"; {cancelled} transposes that undid each other removed" if cancelled else "")
                     + (f"; {shuffles} channel shuffles, splits, concatenations and scalar elementwise ops moved past "
                        "their layout transposes" if shuffles else ""))
    return mod


def ChannelsLast(*, log: RewriteLog, kernel_layout: str = "OHWI",
                 conv1d_kernel_layout: str | None = None) -> tvm.transform.Pass:
    """:func:`channels_last` as a Relax module pass."""
    return module_pass("ChannelsLast", lambda mod: channels_last(mod, log=log, kernel_layout=kernel_layout,
                                                                 conv1d_kernel_layout=conv1d_kernel_layout))
