"""The flash template's tile configs: the knobs as data, which fit an attention spec, the default per shape,
and the annotations a tuned sketch records them under."""
from __future__ import annotations

from dataclasses import dataclass

from tvmfuse.kernels.annotations import chosen, root_annotations
from tvmfuse.kernels.wgmma.config import SMS
from tvmfuse.kernels.flash.simt import SimtConfig, parse_simt, simt_configs, simt_default
from tvmfuse.kernels.flash.softmax import kt_vector
from tvmfuse.plan.attention import SPEC_ATTR, AttentionSpec, tiled_gpu_misfit

# On the planner's attention PrimFunc's root block: the candidate configs (names, ";"-joined: a constant of the
# trace, so a record keeps the list it was sampled from) and the sampled index into them.
ANNOTATION = "tvmfuse.flash_config"
CANDIDATES = "tvmfuse.flash_candidates"
# A TMA kernel's dynamic shared memory at most: one block an SM (an H100's and H200's 227 KB a block)
TMA_SHARED_BYTES = 227 * 1024


@dataclass(frozen=True)
class FlashConfig:
    warps: int = 4        # warps per block
    block_n: int = 64     # keys per step
    stages: int = 1       # 1: one K/V buffer, plain loads; 2: two buffers filled by cp.async
    m_tiles: int = 1      # 16-row tiles per warp: 1 keeps Q in registers; 2 stages Q in shared memory and
    #                       uses each K/V fragment for both tiles (half the shared-memory reads per mma)
    wgmma: bool = False   # Hopper (sm_90a): each warpgroup's 64 rows by wgmma from 128-byte-swizzled shared tiles
    #                       (Q, K and V by cp.async), P fed to the PV wgmma from registers (m_tiles 1)
    overlap: bool = False  # (wgmma, 2 stages) the next step's Q·Kᵀ runs on the tensor cores during this step's
    #                        softmax, and this step's P·V during the next step's loads and waits
    tma: int = 0          # (wgmma) 1: warp-specialized, a producer warp loads Q, K and V by TMA into ``stages``
    #                       slots handed over by mbarriers (:mod:`tvmfuse.kernels.flash.tma`); 2: its two computing
    #                       warpgroups also take turns on the tensor cores (ping-pong); 3: and each computes a step's
    #                       softmax while the previous P·V runs

    @property
    def block_m(self) -> int:
        return 16 * self.warps * self.m_tiles

    @property
    def name(self) -> str:
        hopper = " hp" if self.overlap else {1: " ht", 2: " htp", 3: " hto"}.get(self.tma, " h")
        return f"w{self.warps} m{self.m_tiles} n{self.block_n} s{self.stages}" + (hopper if self.wgmma else "")

    @property
    def threads(self) -> int:
        """Threads a block: the computing warps, and a TMA kernel's producer warpgroup."""
        return 32 * self.warps + (128 if self.tma else 0)

    @property
    def mbarriers(self) -> int:
        """A TMA kernel's mbarriers (8 bytes each): Q's, and a slot's K and V full and empty; none otherwise."""
        return 1 + 4 * self.stages if self.tma else 0

    def shared_bytes(self, spec: AttentionSpec) -> int:
        if self.wgmma:   # unpadded (swizzled) tiles, Q staged too; a TMA kernel's mbarriers
            return (2 * (self.stages * self.block_n * (spec.head_dim + spec.head_dim_v) + self.block_m * spec.head_dim)
                    + 8 * self.mbarriers)
        k_tile = self.block_n * (spec.head_dim + 8) if spec.k_rows else spec.head_dim * (self.block_n + 8)
        v_tile = self.block_n * (spec.head_dim_v + 8)
        q_tile = self.block_m * (spec.head_dim + 8) if self.m_tiles > 1 else 0
        return 2 * (self.stages * (k_tile + v_tile) + q_tile)


def configs(spec: AttentionSpec, *, warps=(4, 8), m_tiles=(1, 2), block_n=(32, 64, 128), stages=(1, 2, 3),
            max_shared_bytes: int = 100 * 1024, wgmma=(False,), overlap=(False,), tma=(0,)) -> list[FlashConfig]:
    """The tile configs (from the given choices) that fit ``spec``'s registers and ``max_shared_bytes`` of (dynamic)
    shared memory; the Hopper ones must also divide its sequences (the ``mma.sync`` ones guard a ragged last tile).
    100 KB leaves room for two blocks on an H200 SM (228 KB).
    A TF32 spec (``spec.tf32``) takes the ``mma.sync`` kernel of :mod:`tvmfuse.kernels.flash.tf32`: one 16-row tile
    per warp, no wgmma.
    """
    if spec.tf32:
        from tvmfuse.kernels.flash.tf32 import register_cap, registers, shared_bytes

        return [c for w in warps for n in block_n for st in stages if 1 in tuple(m_tiles) and int(st) in (1, 2)
                for c in [FlashConfig(int(w), int(n), int(st), 1)]
                # (two stages round the copied chunks 16 bytes at a time: Kᵀ's vectors must be whole 4 floats)
                if registers(spec, c) <= register_cap(spec) and shared_bytes(spec, c) <= max_shared_bytes
                and (c.stages == 1 or spec.k_rows or kt_vector(spec) == 4)]
    out = []
    for m in m_tiles if False in tuple(wgmma) else ():
        for w in warps:
            for n in block_n:
                for st in (st for st in stages if int(st) in (1, 2)):   # (3: the TMA kernels' only)
                    c = FlashConfig(int(w), int(n), int(st), int(m))
                    # one thread's scores, P and O (and Q, in registers with one tile) within ~200 of its 255
                    # registers; measured with ptxas: the configs kept here build without spills (164-251)
                    regs = c.m_tiles * (c.block_n // 2 + c.block_n // 4 + spec.head_dim_v // 2)
                    regs += spec.head_dim // 4 if c.m_tiles == 1 else 4 * c.m_tiles
                    # (sequences need not be whole tiles: a ragged last tile is guarded; cp.async copies at least
                    # 4 bytes, which Kᵀ's rows of an odd number of keys do not keep aligned)
                    if (regs <= 200 and c.shared_bytes(spec) <= max_shared_bytes
                            and (c.stages == 1 or spec.k_rows or kt_vector(spec) >= 2)):
                        out.append(c)
    if True in tuple(wgmma) and spec.head_dim % 64 == 0 and spec.head_dim_v % 64 == 0 and spec.head_dim_v <= 256:
        for w in warps:
            for n in block_n:
                for st in (st for st in stages if int(st) in (1, 2)):   # (3: the TMA kernels' only)
                    c = FlashConfig(int(w), int(n), int(st), 1, True)
                    # scores (n / 2), P packed (n / 4) and O (dv / 2) fp32 registers per thread
                    regs = c.block_n // 2 + c.block_n // 4 + spec.head_dim_v // 2
                    if (c.warps in (4, 8) and c.block_n in (64, 128) and regs <= 160
                            and spec.seq_q % c.block_m == 0 and spec.seq_k % c.block_n == 0
                            and c.shared_bytes(spec) <= max_shared_bytes):
                        out.append(c)
        # overlapped: two score accumulators (n registers), two K/V stages, key steps taken in pairs
        if True in tuple(overlap):
            for w in warps:
                for n in block_n:
                    c = FlashConfig(int(w), int(n), 2, 1, True, True)
                    regs = c.block_n + c.block_n // 4 + spec.head_dim_v // 2
                    if (c.warps in (4, 8) and c.block_n in (64, 128) and regs <= 160
                            and spec.seq_q % c.block_m == 0 and spec.seq_k % (2 * c.block_n) == 0
                            and c.shared_bytes(spec) <= max_shared_bytes):
                        out.append(c)
        # warp-specialized by TMA: two computing warpgroups (128 query rows) and a producer, one block an SM (its
        # registers go to the computing warpgroups), so its slots may fill the SM's shared memory
        for t in (t for t in tma if t) if 8 in tuple(warps) else ():
            for n in block_n:
                for st in (st for st in stages if int(st) in (2, 3)):
                    c = FlashConfig(8, int(n), int(st), 1, True, False, int(t))
                    regs = c.block_n // 2 + c.block_n // 4 + spec.head_dim_v // 2
                    if (c.block_n in (64, 128) and regs <= 160 and spec.head_dim <= 256
                            and spec.seq_q % c.block_m == 0 and spec.seq_k % c.block_n == 0
                            and c.shared_bytes(spec) <= TMA_SHARED_BYTES):
                        out.append(c)
    return out


def parse_config(name: str) -> FlashConfig | SimtConfig:
    """The config :attr:`FlashConfig.name` or :attr:`SimtConfig.name` names (``"w4 m2 n32 s1"``,
    ``"c t128 r1 l4 n32"``)."""
    parts = name.split()
    if "c" in parts:
        return parse_simt(name)
    kinds = {"h": 0, "hp": 0, "ht": 1, "htp": 2, "hto": 3}
    fields = dict((part[0], int(part[1:])) for part in parts if part not in kinds)
    return FlashConfig(warps=fields["w"], block_n=fields["n"], stages=fields["s"], m_tiles=fields["m"],
                       wgmma=bool(set(kinds) & set(parts)), overlap="hp" in parts,
                       tma=max([kinds[p] for p in parts if p in kinds], default=0))


def all_configs(spec: AttentionSpec, wgmma: bool = False) -> list:
    """Every config of ``spec`` on CUDA: the tensor-core ones where they fit (``wgmma``: Hopper's too), else the
    CUDA-core kernel's."""
    if tiled_gpu_misfit(spec) is None:
        return configs(spec, wgmma=(False, True) if wgmma else (False,), overlap=(False, True) if wgmma else (False,),
                       tma=(0, 1, 2, 3) if wgmma else (0,))
    return simt_configs(spec)


def default_config(spec: AttentionSpec, wgmma: bool = False, sm_count: int = SMS) -> FlashConfig | SimtConfig:
    """The config an untuned build uses: the fastest measured at the anchor size, where it fits (``wgmma``: on
    Hopper, ``sm_90a``, the wgmma configs first); the CUDA-core kernel's default where no tensor-core config fits
    (it sizes its parallelism to ``sm_count``, the target's SMs: ``tvmfuse.target.device_figures``).

    H200, B4 H32 S4096 D128 (BENCHMARKS.md): wgmma w4 m1 n64 s1 2236 us, w8 m1 n64 s2 2295 us;
    mma.sync w4 m2 n32 3628 us, w8 m1 n128 3878 us, w4 m1 n32 4359 us; the warp-specialized kernel below.
    """
    if tiled_gpu_misfit(spec) is not None:
        return simt_default(spec, sm_count)
    if spec.tf32:
        # H100, BERT-base's attention (8 x 12 x 512, d 64; BENCHMARKS.md): w8 n32 s2 78.9-83.0 us, w4 n32 s2
        # 82.0-86.1, w4 n64 s2 89.3-91.9, single-stage configs 79-152. Four warps: twice the blocks of eight for a
        # short sequence or a small batch
        options = configs(spec)
        for want in (FlashConfig(4, 32, 2, 1), FlashConfig(4, 64, 2, 1)):
            if want in options:
                return want
        return options[0]
    if wgmma:
        options = configs(spec, wgmma=(True,), tma=(3,))
        # warp-specialized by TMA (FlashAttention-3's structure) where it fits, except causal with head dims under 128:
        # H100, attention_causal_gpu.py, w8 n128 s2 hto against w4 n64 s1 h: D128 4 x 32 x 4096 2118 us (1.09x SDPA)
        # against 2432 (1.25x); GQA causal D128 1237 (1.13x) against 1514 (1.38x); D64 8 x 16 x 2048 370 (1.17x)
        # against 405 (1.28x); but causal D64 262 against 253: its 128-row diagonal tiles mask more of their steps
        tma_first = (FlashConfig(8, 128, 2, 1, True, False, 3),) if not (spec.causal and spec.head_dim < 128) else ()
        for want in (*tma_first, FlashConfig(4, 64, 1, 1, True), FlashConfig(8, 64, 2, 1, True)):
            if want in options:
                return want
    options = configs(spec)
    for want in (FlashConfig(4, 32, 1, 2), FlashConfig(8, 128, 1, 1)):
        if want in options:
            return want
    return options[0]


def annotated_config(func) -> FlashConfig | SimtConfig | None:
    """The config a tuned schedule annotated on ``func``'s root block (None: not a flash schedule)."""
    notes = root_annotations(func, ANNOTATION, CANDIDATES)
    return None if notes is None else config_at(str(notes[CANDIDATES]), int(notes[ANNOTATION]))


def config_at(candidates: str, index: int) -> FlashConfig | SimtConfig:
    """Config ``index`` of the ``;``-joined candidate names a record carries."""
    return parse_config(chosen(candidates, index, "flash"))


def spec_of(func) -> AttentionSpec | None:
    attrs = func.attrs
    if attrs is None or SPEC_ATTR not in attrs:
        return None
    return AttentionSpec.from_json(str(attrs[SPEC_ATTR]))
