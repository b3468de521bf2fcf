"""How tokens are cut: tokens per shard, and intermediate blocks per shard in the fast GLU backward, by the scratch
per token each form declares (``tiledmlp.core.form.ShardScratch``; the forms' own: ``tiledmlp.forms.mlp.MLPScratch``,
``tiledmlp.forms.moe.moe_scratch_per_token``, ``tiledmlp.forms.base.norm_scratch_per_token``). Only cuts.

Auto policy (``tiledmlp.enable_tiling`` defaults), measured on an H200 for the Llama-3-8B MLP
(``benchmarks/bench_tiles.py``, ``docs/sharding.md``):

=====================  ==================================================================================
form                   shard size
=====================  ==================================================================================
fast GLU / MLP form    backward: for one and for two intermediate blocks, the largest shard up to
                       16384 tokens whose backward scratch (``MLPScratch``: gate and up
                       rows of a block, or up alone for a plain MLP, plus one ``dh`` column block)
                       fits ``scratch_mib`` (default
                       512 MiB); of the two, the one needing fewer shards (then one block). Below
                       1024 tokens the intermediate dimension is split further instead. Shards are
                       made equal-sized. Forward: equal parts of a backward shard whose gate and up
                       rows fit the same budget.
MoE form (experts)     the largest shard up to 16384 tokens whose backward scratch
                       (``moe_scratch_per_token``: ``k`` rows per token) fits ``scratch_mib`` (default
                       ``DEFAULT_MOE_SCRATCH_MIB``, 2048: see there); equal shards
generic form           the anchors' rule, ``ceil(tokens / hidden)`` shards
normalization layer    the largest equal shards up to 16384 tokens whose float32 copies
                       (``norm_scratch_per_token``) fit ``scratch_mib`` (default 512 MiB: 8192
                       tokens of a 2048-wide layer)
``num_shards=N``       ``ceil(tokens / N)`` tokens
``tile_tokens=R``      ``R`` tokens (the last shard may be smaller)
=====================  ==================================================================================

The tiled loss (LM head + cross-entropy) has its own rule, :func:`loss_tile`.

Fewer shards are faster: each is a pass over the weight-gradient accumulators. A shard costs about
``2.3 * rows * intermediate`` elements of backward scratch with one intermediate block and half that
with two, so within one budget two blocks allow shards twice as long; the second block costs narrower
GEMMs and two more input-gradient adds, which measured less than the accumulator pass they save. The
default budget fits 16384-token shards in two blocks (or 8192 in one) of the Llama-3-8B MLP and keeps
its peak below the anchors'; smaller budgets trade speed for memory. Block widths are multiples of
64 elements (16-byte aligned bf16 columns): misaligned column blocks send cuBLAS to kernels ~4x slower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .form import ShardScratch

__all__ = ["ShardPolicy", "auto_num_shards", "chunk_bounds", "dh_blocks",
           "DEFAULT_SCRATCH_MIB", "DEFAULT_MOE_SCRATCH_MIB", "MAX_AUTO_TILE", "MAX_AUTO_INTER_CHUNKS", "DH_SPLIT",
           "PLAIN_DH_WHOLE_MAX", "LossTile", "loss_tile",
           "loss_budget_bytes", "fused_loss_budget_bytes", "DEFAULT_LOSS_SCRATCH_MIB", "LOSS_PARTIAL_MIB",
           "LOSS_MODES", "MIN_FUSED_ROWS"]

DEFAULT_SCRATCH_MIB = 512
#: The MoE form's default budget. Each shard is a pass over every expert's weight-gradient accumulator
#: (all experts: E times a dense MLP's weights), so shard count costs far more than for a dense MLP. On an
#: H200 (bf16, forward+backward against untiled grouped_mm): Mixtral-8x7B block at 32K tokens 1.59x /
#: 1.33x / 1.15x / 1.10x with 512 / 1024 / 2048 / 4096 MiB, Qwen3-30B-A3B block 1.52x / 1.14x / 0.90x /
#: 0.82x; at 8K the Mixtral block's peak is 3.8 GiB with 2048 MiB against untiled's 3.9 (4.4 with 4096).
DEFAULT_MOE_SCRATCH_MIB = 2048
MAX_AUTO_TILE = 16384  # tokens per backward shard; beyond this, measured no faster (H200, Llama-3-8B MLP)
MAX_AUTO_INTER_CHUNKS = 2  # more intermediate blocks measured slower (narrower GEMMs, more input-gradient adds)
_MIN_TILE = 1024  # below this, split the intermediate dimension rather than the tokens
_QUANTUM = 1024
DH_SPLIT = 4  # the GLU backward computes dh in this many column blocks of the intermediate dimension...
_DH_BLOCK_MIN = 1024  # ...each at least this wide (narrower GEMMs lose more than the scratch is worth)
PLAIN_DH_WHOLE_MAX = 8192  # a plain MLP's dh is one block up to this width (dh_blocks)


_ALIGN = 64  # block widths in elements: GEMMs on 16-byte-misaligned column blocks fall back to kernels ~4x slower
# dh blocks are multiples of 1024 columns: for the Llama-3-8B MLP, blocks of 4096/4096/4096/2048 make
# cuBLAS (H200, torch 2.11) pick a faster kernel for the down projection's weight gradient than four
# blocks of 3584 do: a 128K-token step 1.5% faster, measured side by side (docs/benchmarks.md).
_DH_ALIGN = 1024


def chunk_bounds(size: int, chunks: int, align: Optional[int] = None) -> list[tuple[int, int]]:
    """``chunks`` near-equal ``[start, stop)`` blocks of ``range(size)`` (fewer if ``size`` is small),
    each but the last a multiple of ``align`` (default 64) wide, so that every block starts 16-byte
    aligned."""
    align = _ALIGN if align is None else align
    step = -(-size // max(1, chunks))
    if step < size:
        step = -(-step // align) * align
    return [(start, min(start + step, size)) for start in range(0, size, step)]


def dh_blocks(width: int, gated: bool = True) -> list[tuple[int, int]]:
    """Column blocks in which the fast backward computes ``dh`` over an intermediate block of ``width``.

    The pre-activations (``gate`` and ``up``, or ``up``) are recomputed whole (big GEMMs), but for a
    GLU ``dh``, and the ``h`` that the activation kernel writes over it, exist one block at a time: the
    scratch is ``2 + 1/blocks`` rows of ``width`` instead of 3, for the price of splitting two of the
    seven GEMMs of a shard. Blocks are multiples of 1024 wide (``_DH_ALIGN``), so the last one may be
    narrower.

    A plain MLP (``gated=False``) computes ``dh`` whole up to ``PLAIN_DH_WHOLE_MAX`` columns, where a
    ``MAX_AUTO_TILE``-token bf16 shard (``up`` and ``dh``, 2 rows of ``width``) still fits the default
    budget: its GEMMs are small, so splitting two of them costs more than the scratch it saves. Measured
    side by side on an H200 (bf16, forward+backward, one build run with either rule): GPT-2-XL shape
    (H=1600, I=6400) 1.16x / 1.19x eager at 32K / 128K tokens whole, against 1.24x / 1.21x in blocks of
    2048 and a 256-wide tail. Wider (Phi-2, I=10240), a whole ``dh`` would shrink the shards below
    ``MAX_AUTO_TILE`` tokens or split the intermediate dimension: 1.21x / 1.18x against 1.17x / 1.17x in
    blocks.
    """
    if not gated and width <= PLAIN_DH_WHOLE_MAX:
        return [(0, width)]
    return chunk_bounds(width, max(1, min(DH_SPLIT, width // _DH_BLOCK_MIN)), _DH_ALIGN)


def auto_num_shards(tokens: int, hidden: int) -> int:
    """The anchors' rule: ``ceil(tokens / hidden)``, at least 1."""
    return max(1, math.ceil(tokens / hidden))


def _check_positive(name: str, value, kind: type = int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (kind, int)):
        what = "an int" if kind is int else "a number"
        raise TypeError(f"{name} must be {what} >= 1 or None, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1 (or None for the automatic policy), got {value}")


def check_mib(name: str, value: object, *, zero_allowed: bool = False, none_means: str = "the default") -> None:
    """A memory option in MiB: a finite number above 0 (0 too where ``zero_allowed``: the plan's budgets), or None
    for ``none_means``; ``TypeError``/``ValueError`` naming the option otherwise. Fractions are budgets too: tests cut
    tiny models into many shards with them."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a {'' if zero_allowed else 'positive '}number of MiB (an int or float, such "
                        f"as 80000 for about 78 GiB) or None for {none_means}, got {type(value).__name__} {value!r}")
    if math.isnan(value) or not (0 <= value if zero_allowed else 0 < value) or value == math.inf:
        bound = "a finite number of MiB >= 0" if zero_allowed else "a positive number of MiB"
        raise ValueError(f"{name} must be {bound}, or None for {none_means}, got {value!r}")


def format_mib(nbytes: float) -> str:
    """``nbytes`` in MiB for messages: whole MiB from 10 MiB on, two significant digits below (never "0 MiB")."""
    mib = nbytes / 2**20
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.2g} MiB"


def _fitting_rows(budget: float, bytes_per_token: int) -> int:
    """The most tokens (a multiple of ``_QUANTUM``, at most ``MAX_AUTO_TILE``) whose scratch fits ``budget``."""
    return min(MAX_AUTO_TILE, int(budget // bytes_per_token) // _QUANTUM * _QUANTUM)


def _equalize(tokens: int, rows: int) -> int:
    """Same shard count, equal shards: ``ceil(tokens / ceil(tokens / rows))``."""
    return math.ceil(tokens / math.ceil(tokens / rows))


@dataclass(frozen=True)
class ShardPolicy:
    """Chooses tokens per shard (and GLU intermediate blocks) for one call."""

    num_shards: Optional[int] = None
    tile_tokens: Optional[int] = None
    #: blocks of the intermediate dimension per token shard in the GLU backward (None: automatic)
    inter_chunks: Optional[int] = None
    #: backward scratch budget of the fast GLU form, in MiB (None: ``DEFAULT_SCRATCH_MIB``)
    scratch_mib: Optional[float] = None

    def __post_init__(self) -> None:
        _check_positive("num_shards", self.num_shards)
        _check_positive("tile_tokens", self.tile_tokens)
        _check_positive("inter_chunks", self.inter_chunks)
        check_mib("scratch_mib", self.scratch_mib)
        if self.num_shards is not None and self.tile_tokens is not None:
            raise ValueError("give num_shards or tile_tokens, not both: each fixes the shard size")

    def _budget_bytes(self) -> float:
        return (self.scratch_mib or DEFAULT_SCRATCH_MIB) * 2**20

    def _fixed_rows(self, tokens: int) -> Optional[int]:
        if self.tile_tokens is not None:
            return min(self.tile_tokens, tokens)
        if self.num_shards is not None:
            return math.ceil(tokens / self.num_shards)
        return None

    def one_shard(self, tokens: int) -> bool:
        """Whether a fast form's call over ``tokens`` tokens is cut into a single shard (decode, short prompts),
        cheaply: a fixed cut that covers them, or no more than the smallest automatic shard (``_MIN_TILE``
        tokens). The generic form's calls ask their shard size itself (``forms.spec.FormSpec.generic_rows``)."""
        fixed = self._fixed_rows(max(tokens, 1))
        if fixed is not None:
            return fixed >= tokens
        return tokens <= _MIN_TILE

    def shard_rows(self, tokens: int, hidden: int) -> int:
        """Tokens per shard for the generic form (a module whose scratch we cannot size)."""
        tokens = max(tokens, 1)
        fixed = self._fixed_rows(tokens)
        return fixed if fixed is not None else math.ceil(tokens / auto_num_shards(tokens, hidden))

    def norm_rows(self, tokens: int, bytes_per_token: int) -> int:
        """Tokens per shard of a normalization layer (``tiledmlp.recognize.norms``), whose float32 copies take
        ``bytes_per_token`` (``tiledmlp.forms.base.norm_scratch_per_token``): a fixed cut, or the largest equal shards
        up to ``MAX_AUTO_TILE`` tokens whose copies fit the budget."""
        tokens = max(tokens, 1)
        fixed = self._fixed_rows(tokens)
        if fixed is not None:
            return fixed
        fits = int(self._budget_bytes() // bytes_per_token)
        return _equalize(tokens, max(1, min(MAX_AUTO_TILE, fits)))

    def mlp_tile(self, tokens: int, scratch: ShardScratch) -> tuple[int, int]:
        """``(tokens per backward shard, intermediate blocks)`` for a fast MLP form, by the ``scratch`` it declares
        (``tiledmlp.forms.mlp.MLPScratch``).

        Automatic choice: for each block count up to ``MAX_AUTO_INTER_CHUNKS`` (or the one given), the
        largest shard whose scratch fits the budget; of these, the one with the fewest shards (each
        shard is a pass over the weight-gradient accumulators), then the fewest blocks.
        """
        tokens = max(tokens, 1)
        budget = self._budget_bytes()
        rows, chunks = self._fixed_rows(tokens), self.inter_chunks
        if rows is None:
            counts = [chunks] if chunks is not None else range(1, MAX_AUTO_INTER_CHUNKS + 1)
            fits = {c: _fitting_rows(budget, scratch.backward_bytes_per_token(c)) for c in counts}
            fits = {c: r for c, r in fits.items() if r >= _MIN_TILE}
            if fits:
                best = min(fits, key=lambda c: (math.ceil(tokens / fits[c]), c))
                return _equalize(tokens, fits[best]), best
            rows = min(_MIN_TILE, tokens)  # even the smallest shard is over budget: split the intermediate more
        if chunks is None:
            chunks = 1
            while chunks < scratch.max_blocks and rows * scratch.backward_bytes_per_token(chunks) > budget:
                chunks += 1
        return rows, chunks

    def mlp_cut(self, tokens: int, scratch: ShardScratch) -> tuple[int, int, int]:
        """``(tokens per backward shard, intermediate blocks, tokens per forward shard)`` of one fast-form call:
        :meth:`mlp_tile`, then :meth:`mlp_forward_rows` of its shards, asked in one step."""
        rows, chunks = self.mlp_tile(tokens, scratch)
        return rows, chunks, self.mlp_forward_rows(scratch, rows)

    def moe_rows(self, tokens: int, bytes_per_token: int) -> int:
        """Tokens per shard of the MoE form, whose scratch takes ``bytes_per_token``
        (``tiledmlp.forms.moe.moe_scratch_per_token``): a fixed cut, or the largest equal shards up to
        ``MAX_AUTO_TILE`` tokens whose scratch fits the budget."""
        tokens = max(tokens, 1)
        fixed = self._fixed_rows(tokens)
        if fixed is not None:
            return fixed
        budget = (self.scratch_mib or DEFAULT_MOE_SCRATCH_MIB) * 2**20
        return _equalize(tokens, max(1, min(MAX_AUTO_TILE, int(budget // bytes_per_token))))

    def mlp_forward_rows(self, scratch: ShardScratch, backward_rows: int) -> int:
        """Tokens per forward shard of a fast form: the backward's ``backward_rows``, or fewer when the forward's
        own scratch (``scratch.forward_bytes_per_token()``) would exceed the budget."""
        budget = self._budget_bytes()
        fits = max(1, int(budget // scratch.forward_bytes_per_token()))
        return math.ceil(backward_rows / math.ceil(backward_rows / fits))  # equal parts of a backward shard


# ----------------------------------------------------------------------------------------------
# The tiled loss

DEFAULT_LOSS_SCRATCH_MIB = 256
LOSS_PARTIAL_MIB = 32  # a block-scaled head gradient's partial-sum buffer (``GradAccumulator``), inside the budget
LOSS_MODES = ("auto", "fused", "recompute")
#: below this many tokens per fused shard, the head gradient's accumulator passes (one per shard, over
#: the whole vocab x hidden weight) cost more than recomputing the logits once ("recompute" mode). On an
#: H100 (H=4096, V=262144) fused shards of ~440 tokens still beat recompute by 7-19% (bench_loss).
MIN_FUSED_ROWS = 256
_LOSS_ROWS = 4096  # tokens per shard when the vocabulary is chunked
_LOSS_MIN_CHUNK = 1024  # vocabulary columns per chunk below which shards get fewer tokens instead


@dataclass(frozen=True)
class LossTile:
    """How one tiled loss call is cut.

    ``fused``: each shard of ``rows`` tokens computes the logits of the whole vocabulary at once (one
    ``[rows, vocab]`` chunk), its loss and, in the same pass, every gradient (``grads_in_forward``):
    6 T·H·V FLOP in all, like the untiled loss. Otherwise the vocabulary is cut into chunks of
    ``vocab_chunk`` columns with an online logsumexp, and backward recomputes the logits (8 T·H·V).
    """

    rows: int
    vocab_chunk: int
    fused: bool
    #: the head gradient's partial-sum buffer (``GradAccumulator``), inside the budget; 0 without one
    partial_mib: float


def loss_budget_bytes(hidden_bytes: int, scratch_mib: Optional[float] = None) -> int:
    """The loss's scratch budget: ``scratch_mib`` MiB, or by default the larger of
    ``DEFAULT_LOSS_SCRATCH_MIB`` and the hidden states' own size."""
    if scratch_mib is not None:
        return int(scratch_mib * 2**20)
    return max(DEFAULT_LOSS_SCRATCH_MIB * 2**20, hidden_bytes)


def _align_down(value: int, limit: int) -> int:
    """``value`` capped at ``limit`` and, when at least ``_ALIGN``, rounded down to a multiple of it."""
    value = min(value, limit)
    return value if value < _ALIGN or value == limit else value // _ALIGN * _ALIGN


def fused_loss_budget_bytes(vocab: int, itemsize: int, scaled_sums: bool) -> int:
    """A budget (bytes) with which :func:`loss_tile` fuses shards of ``MIN_FUSED_ROWS`` tokens: their logits
    and, with ``scaled_sums``, the whole partial buffer (which a smaller budget caps at a quarter of
    itself, so this may be more than the least that fuses, never less)."""
    return MIN_FUSED_ROWS * vocab * itemsize + (LOSS_PARTIAL_MIB * 2**20 if scaled_sums else 0)


def loss_tile(tokens: int, vocab: int, hidden: int, itemsize: int, budget: int, mode: str = "auto",
              fusable: bool = True, scaled_sums: bool = False) -> LossTile:
    """Shards (and vocabulary chunks) of a tiled loss call whose logits take ``itemsize`` bytes.

    ``budget`` (bytes, :func:`loss_budget_bytes`) bounds every logits chunk together with the other
    scratch of a shard: with ``scaled_sums`` (the head gradient summed block-scaled, which needs its
    partials as tensors) the partial buffer (``LOSS_PARTIAL_MIB``, at most a quarter of the budget)
    and, when the vocabulary is chunked, the shard's float32 input-gradient sum. Float32 (or bf16)
    sums take no partial buffer: cuBLAS adds each GEMM into the accumulator, so the logits get the whole
    budget (larger shards, faster: measured in ``docs/loss.md``).
    ``fusable``: the caller sums the per-token losses and wants gradients (so they may be finished in
    forward). ``mode="auto"`` fuses when a fused shard holds at least ``MIN_FUSED_ROWS`` tokens (or
    all of them).
    """
    if mode not in LOSS_MODES:
        raise ValueError(f"unknown loss mode {mode!r}; choose one of {list(LOSS_MODES)}")
    tokens = max(tokens, 1)
    partial = min(LOSS_PARTIAL_MIB * 2**20, budget // 4) if scaled_sums else 0
    room = max(budget - partial, 1)
    fused_rows = max(1, _align_down(room // (vocab * itemsize), tokens))
    if fusable and (mode == "fused" or (mode == "auto" and fused_rows >= min(MIN_FUSED_ROWS, tokens))):
        return LossTile(_equalize(tokens, fused_rows), vocab, True, partial / 2**20)
    rows = min(tokens, _LOSS_ROWS)
    while True:
        chunk = (room - rows * hidden * 4) // (rows * itemsize)  # the shard's float32 dx sum is scratch too
        if chunk >= min(_LOSS_MIN_CHUNK, vocab) or rows <= _ALIGN:
            break
        rows //= 2
    return LossTile(_equalize(tokens, rows), max(1, _align_down(chunk, vocab)), False, partial / 2**20)
