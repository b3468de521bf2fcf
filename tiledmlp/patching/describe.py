"""What tiling did to a model: one :class:`TileInfo` per tiled module, and the log lines of
``enable_tiling``.

``describe(model, seq_len=131072)`` answers, per tiled module: which form it got (``"glu"``, ``"mlp"``: the fast
forms; ``"moe"``: a MoE layer's experts, routed once; ``"generic"``: the module's own forward, recomputed (also a
whole MoE block whose experts the MoE form cannot compute); ``"norm"``: a normalization layer on the generic form
(``enable_tiling(norms=True)``); ``"proj"``: a LoRA-adapted projection (``enable_tiling(projections=True)``, its
fast form or, with the reason, the generic one); ``"loss"``: the tiled LM head + cross-entropy), why it is generic
when it is, which strategy serves it under the model's current wrapping, what its calls do inside ``torch.compile``d
code (``under_compile``: one operator in the graph, or the eager call), and how a call of ``seq_len`` tokens would
be cut (shards, tokens per shard, intermediate blocks) with the scratch that costs. Scratch is what the shard policy
sizes, in the parameters' dtype: a fast form's recomputed intermediates (gate/up and one ``dh`` block per backward
shard), the MoE form's rows (at the model config's top-k), a normalization layer's or LoRA projection's float32
copies of its input, the loss's scratch budget; for the generic form it depends on the module's own forward and is
not estimated.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
from torch import nn

from ..attention.layers import attention_layers
from ..core.accumulate import block_scaled
from ..core.logs import counted
from ..core.places import Place
from ..core.sharding import ShardPolicy, format_mib, loss_budget_bytes, loss_tile
from ..distributed.tensor_parallel import read_style
from ..forms.base import norm_scratch_per_token
from ..forms.kind import Kind
from ..forms.mlp import MLPScratch
from ..forms.moe import ExpertsLayout, moe_scratch_per_token
from ..forms.quant import QuantizedLinear
from ..loss.heads import HeadSpec
from ..offload.checkpointing import SMALL, LayerPlacement, layer_placement, offload_problems, offloaded_layers
from ..plan.plans import MemoryPlan, plan_memory
from .call_spec import TiledCallSpec
from .patch import check_model, tiled_states
from .state import TilingState

__all__ = ["TileInfo", "Description", "describe", "log_summary", "DEFAULT_DESCRIBE_TOKENS"]

log = logging.getLogger("tiledmlp")
DEFAULT_DESCRIBE_TOKENS = 131072  # the sequence length of enable_tiling's summary line
#: what a model without a tiled module is described as
NOT_TILED = "not tiled: no module of this model is tiled (tiledmlp.enable_tiling(model) tiles it)"


@dataclass(frozen=True)
class TileInfo:
    """How one module is tiled (see the module docstring)."""

    name: str
    form: str  # the value of the module's Kind (tiledmlp.forms.kind), a plain str
    strategy: str
    reason: str  # why the module is generic ("" otherwise)
    computes: str  # what a fast form computes, in the module's names ("" for the others)
    policy: str  # the shard policy, in words
    # what a call does inside torch.compile'd code: "operator" (one graph node), or the eager path and why
    under_compile: str = ""
    tokens: Optional[int] = None  # the sequence length the figures below are for
    num_shards: Optional[int] = None
    shard_tokens: Optional[int] = None  # tokens per (backward) shard
    inter_chunks: Optional[int] = None  # intermediate blocks per shard (fast forms)
    scratch_bytes: Optional[int] = None  # peak scratch of one call; None: not estimated
    fallback: str = ""  # calls seen to take the untiled path, and why ("" if none)

    @property
    def scratch_mib(self) -> Optional[float]:
        return None if self.scratch_bytes is None else self.scratch_bytes / 2**20


class Description(dict):
    """``{qualified name: TileInfo}``, printable as a table (``str()``/``repr()``) and as one line
    (:meth:`summary`)."""

    def __init__(self, infos: dict[str, TileInfo], tokens: Optional[int], offloaded: Sequence[str] = (),
                 not_offloaded: Optional[dict[str, str]] = None, attention: Optional[dict[str, str]] = None,
                 on_cpu: bool = False, memory: Optional[MemoryPlan] = None, placed: str = "",
                 offload: str = "cpu") -> None:
        super().__init__(infos)
        self.tokens = tokens
        self.on_cpu = on_cpu  # every parameter of the model is in host memory
        self.offloaded = list(offloaded)  # modules whose checkpointed inputs wait in host memory
        # modules offload="cpu" was enabled for whose inputs stay on the device now, and why
        self.not_offloaded = dict(not_offloaded or {})
        # layers attention=True was enabled in -> what their attention calls did (tiledmlp.attention)
        self.attention = dict(attention or {})
        # the memory plan of one step of ``tokens`` (tiledmlp.plan; None without a length, or for a model it cannot
        # plan: no decoder config or no checkpointed layers)
        self.memory = memory
        self.placed = placed  # offload="auto": where the last step's layer inputs waited ("not run yet" before one)
        self.offload = offload  # the offload option of the offloaded layers: "cpu" or "auto"

    def summary(self) -> str:
        """One line: ``tiled 32 MLPs: 32 glu, strategy fsdp2, ~448 MiB scratch at 128K tokens``."""
        infos = list(self.values())
        if not infos:
            return NOT_TILED
        mlps = [i for i in infos if i.form not in (Kind.LOSS, Kind.NORM, Kind.PROJ)]
        forms = {f: sum(i.form == f for i in mlps) for f in (Kind.GLU, Kind.MLP, Kind.MOE, Kind.GENERIC)}
        parts = [f"tiled {counted(len(mlps), 'MLP')}"
                 + (": " + ", ".join(f"{n} {f}" for f, n in forms.items() if n) if mlps else "")]
        norms = sum(i.form == Kind.NORM for i in infos)
        if norms:
            parts.append(counted(norms, "normalization layer"))
        projections = sum(i.form == Kind.PROJ for i in infos)
        if projections:
            parts.append(counted(projections, "LoRA projection"))
        heads = [(i.name or "<root>") + (f" (untiled: {i.fallback})" if i.fallback else "")
                 for i in infos if i.form == Kind.LOSS]
        if heads:
            parts.append(f"loss tiled at {', '.join(heads)}")
        fell_back = Counter(i.fallback for i in infos if i.fallback and i.form != Kind.LOSS)
        if fell_back:  # what calls did instead of what was planned, as the table's rows say
            parts.append(f"{counted(sum(fell_back.values()), 'module')} not as planned ("
                         + "; ".join(f"{k} x {why}" for why, k in fell_back.most_common(2))
                         + ("; ..." if len(fell_back) > 2 else "") + ")")
        strategies = sorted({i.strategy for i in infos})
        parts.append(f"strateg{'y' if len(strategies) == 1 else 'ies'} {', '.join(strategies)}")
        sized = [i.scratch_bytes for i in infos if i.scratch_bytes is not None]
        if sized and self.tokens:
            # Modules run one after another: the peak is the largest, not the sum.
            parts.append(f"~{max(sized) / 2**20:.0f} MiB scratch at {_tokens(self.tokens)} tokens")
        layers = counted(len(self.offloaded), "layer")
        if self.offloaded and self.placed:
            parts.append(f"checkpointed inputs of {layers} placed by the memory plan "
                         f"(offload='auto'; last step: {self.placed})")
        elif self.offloaded:
            parts.append(f"checkpointed inputs of {layers} offloaded to host"
                         + (" (the model is on the CPU: copied within host memory, nothing saved)"
                            if self.on_cpu else ""))
        if self.not_offloaded:
            parts.append(f"offload={self.offload!r} off for {counted(len(self.not_offloaded), 'layer')}: "
                         f"{sorted(set(self.not_offloaded.values()))[0]}")
        if self.attention:
            said = Counter(self.attention.values())
            parts.append(f"attention=True in {counted(len(self.attention), 'layer')} ("
                         + ("; ".join(f"in {counted(n, 'layer')}: {what}" for what, n in said.most_common(2))
                            if len(said) > 1 else next(iter(said))) + ("; ..." if len(said) > 2 else "") + ")")
        return ", ".join(parts)

    def __str__(self) -> str:
        if not self:
            return self.summary()
        head = ("name", "form", "strategy", "shards x tokens", "scratch", "computes / why generic")
        rows = [head] + [(
            i.name or "<root>", i.form, i.strategy,
            f"{i.num_shards} x {i.shard_tokens}" + (f" ({i.inter_chunks} blocks)" if (i.inter_chunks or 1) > 1 else "")
            if i.num_shards else i.policy,
            "?" if i.scratch_bytes is None else format_mib(i.scratch_bytes),
            (i.reason or i.computes) + (f"; untiled: {i.fallback}" if i.fallback else "")) for i in self.values()]
        widths = [max(len(r[k]) for r in rows) for k in range(len(head) - 1)]
        lines = [self.summary()] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
        lines += self.memory.table().splitlines() if self.memory is not None else []
        return "\n".join(line.rstrip() for line in lines)

    __repr__ = __str__


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


def _policy_words(policy: ShardPolicy) -> str:
    if policy.tile_tokens is not None:
        return f"tile_tokens={policy.tile_tokens}"
    if policy.num_shards is not None:
        return f"num_shards={policy.num_shards}"
    return f"auto ({policy.scratch_mib or 'default'} MiB budget)" if policy.scratch_mib else "auto"


def _info(name: str, state: TilingState, strategy: str, tokens: Optional[int]) -> TileInfo:
    spec = state.spec
    if state.kind == Kind.LOSS:
        return _loss_info(name, state, strategy, tokens)
    policy = spec.policy
    base = dict(name=name, form=str(state.kind), strategy=strategy, reason=state.reason, computes=state.computes,
                policy=_policy_words(policy), tokens=tokens, fallback=state.fallback,
                under_compile="operator" if state.traced is not None and not spec.quantized
                else "eager call, one graph break")
    params = state.params()
    if tokens is None or params is None:
        return TileInfo(**base)
    layout = spec.layout
    if isinstance(layout, ExpertsLayout):
        return _moe_info(base, state, params, tokens)
    if state.kind == Kind.PROJ:  # sized by float32 copies of its input, and a 4-bit weight's dequantized copy
        owner = spec.slots[0].owner  # the base layer: a 4-bit weight is packed, a Conv1D's is [in, out]
        hidden = getattr(owner, "in_features", None) or owner.nx
        rows = spec.form.generic_rows(tokens, hidden)
        return TileInfo(**base, num_shards=math.ceil(tokens / rows), shard_tokens=rows,
                        scratch_bytes=rows * norm_scratch_per_token(hidden) + _dequantized_bytes(spec))
    if layout is None:  # generic: scratch depends on the module's forward, but for a normalization layer
        norm = state.kind == Kind.NORM
        hidden = params[0].shape[-1] if norm else next((p.shape[-1] for p in params if p.dim() == 2), None)
        if hidden is None:  # 1-D shards
            return TileInfo(**base)
        rows = spec.form.generic_rows(tokens, hidden)
        return TileInfo(**base, num_shards=math.ceil(tokens / rows), shard_tokens=rows,
                        scratch_bytes=rows * norm_scratch_per_token(hidden) if norm else None)
    # Sizes from the modules, not the tensors: a wrapper may hold shards (FSDP1 use_orig_params) or views.
    down = spec.slots[layout.down.weight].owner
    inter = getattr(down, "in_features", None) or getattr(down, "nx", None)
    if inter is None:
        return TileInfo(**base)
    style = read_style(down)
    if style is not None:  # tensor parallel: each rank tiles its slice of the intermediate dimension
        inter //= style.mesh.size()
    # 4-bit weights: the compute dtype's size, and their dequantized copies beside the shards while a pass runs
    itemsize = (_compute_itemsize(spec.quantized[0][1]) if spec.quantized
                else params[layout.down.weight].element_size())
    dequantized = _dequantized_bytes(spec)
    mlp = MLPScratch(inter, itemsize, layout.gated)
    rows, chunks, forward_rows = policy.mlp_cut(tokens, mlp)
    scratch = dequantized + max(rows * mlp.backward_bytes_per_token(chunks),
                                forward_rows * mlp.forward_bytes_per_token())
    return TileInfo(**base, num_shards=math.ceil(tokens / rows), shard_tokens=rows, inter_chunks=chunks,
                    scratch_bytes=scratch)


def _compute_itemsize(q: QuantizedLinear) -> int:
    """Bytes per element of a 4-bit layer's dequantized weight (its compute dtype's)."""
    return torch.finfo(getattr(q.module, "compute_dtype", None) or torch.bfloat16).bits // 8


def _dequantized_bytes(spec: TiledCallSpec) -> int:
    """The dequantized copies of a fast form's 4-bit weights, alive while a pass runs."""
    return sum(q.module.in_features * q.module.out_features * _compute_itemsize(q) for _, q in spec.quantized)


def _moe_info(base: dict, state: TilingState, params: list[torch.Tensor], tokens: int) -> TileInfo:
    """Shards of the MoE form at the top-k of the experts' config (transformers'), if it says."""
    top_k = getattr(getattr(state.spec.slots[0].owner, "config", None), "num_experts_per_tok", None)
    layout = state.spec.layout.remap(list(range(len(params))))
    if not isinstance(top_k, int) or any(p.dim() != 3 for p in (params[layout.up], params[layout.down])):
        return TileInfo(**base)  # no top-k to size by, or sharded weights
    hidden = layout.w_up(params).shape[1]
    itemsize = params[layout.up].element_size()
    per_token = moe_scratch_per_token(hidden, layout.inter(params), layout.up_width(params), top_k, itemsize)
    rows = state.spec.policy.moe_rows(tokens, per_token)
    return TileInfo(**base, num_shards=math.ceil(tokens / rows), shard_tokens=rows, scratch_bytes=rows * per_token)


def _loss_info(name: str, state: TilingState, strategy: str, tokens: Optional[int]) -> TileInfo:
    spec: HeadSpec = state.spec
    options = spec.options
    words = f"mode {options.mode}" + (f", {options.scratch_mib} MiB budget" if options.scratch_mib else "")
    base = dict(name=name, form=str(Kind.LOSS), strategy=strategy, reason="", policy=words, tokens=tokens,
                computes=f"LM head + cross-entropy of {spec.owner.name}", fallback=state.fallback,
                under_compile="untiled loss (real logits); tiled when the head runs outside compiled code")
    params = state.params()
    if tokens is None or params is None:
        return TileInfo(**base)
    head = spec.slots[0].owner  # sizes from the module: a wrapper may hold a shard of the weight
    vocab, hidden, itemsize = head.out_features, head.in_features, params[0].element_size()
    budget = loss_budget_bytes(tokens * hidden * itemsize, options.scratch_mib)
    tile = loss_tile(tokens, vocab, hidden, itemsize, budget, options.mode,
                     scaled_sums=block_scaled(options.grad_accum_dtype, params[0].dtype))
    return TileInfo(**base, num_shards=math.ceil(tokens / tile.rows), shard_tokens=tile.rows, scratch_bytes=budget)


def describe(model: nn.Module, seq_len: Optional[int] = None) -> Description:
    """``{qualified name: TileInfo}`` for every module of ``model`` that ``enable_tiling`` tiled.

    ``seq_len``: tokens per call (all of a batch's tokens: ``batch * sequence``) for which to give
    shards and scratch, and (a Hugging Face causal LM with checkpointed layers) the memory plan of one step
    (:func:`plan_memory`, printed after the table, ``Description.memory``); None: forms, strategies and policies
    only. ``model`` may be the wrapper:
    strategies are resolved against its current wrapping. Costs no computation and no communication.
    """
    check_model(model, "describe")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ValueError(f"seq_len must be a positive int (tokens per call) or None, got {seq_len!r}")
    description = _described(model, seq_len)
    description.memory = _memory_plan(model, seq_len)
    return description


def _described(model: nn.Module, seq_len: Optional[int]) -> Description:
    infos = {}
    for name, module, state, strategy in tiled_states(model):
        info = infos[name] = _info(name, state, strategy, seq_len)
        changes = state.changes(module)
        if changes:  # planned again by the call (under ZeRO-3 or TP the probe is a collective: not here)
            infos[name] = replace(info, fallback=f"its submodules changed since enable_tiling ({changes}): planned "
                                  "again at its next call")
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    placement = layer_placement(model)
    return Description(infos, seq_len, offloaded_layers(model), offload_problems(model), attention_layers(model),
                       on_cpu, placed=_placed(placement), offload=placement.offload if placement else "cpu")


def _placed(placement: Optional[LayerPlacement]) -> str:
    """offload="auto": where the layer inputs waited in each layer's last call, on any device: how many were kept,
    sent to the host, recomputed, or too small to move ("" otherwise)."""
    if placement is None or placement.offload != "auto":
        return ""
    if not placement.last:
        return "not run yet"
    counts = Counter(placement.last.values())
    return ", ".join(f"{counts[p]} {word}" for p, word in ((Place.GPU, "kept"), (Place.HOST, "on the host"),
                                                            (Place.RECOMPUTE, "recomputed"),
                                                            (SMALL, "kept (too small to move)")) if counts[p])


def _memory_plan(model: nn.Module, seq_len: Optional[int]) -> Optional[MemoryPlan]:
    """The plan of one step of ``seq_len`` tokens, where ``model`` is one the planner models."""
    if seq_len is None:
        return None
    try:
        plan = plan_memory(model, seq_len)
    except ValueError as why:  # no decoder config
        log.debug("describe: no memory plan for %s: %s", type(model).__name__, why)
        return None
    # a model without checkpointing is planned by plan_memory, with terms not measured: not shown unasked
    return plan if plan.checkpointed else None


def log_summary(model: nn.Module) -> None:
    """``enable_tiling``'s log lines: one INFO summary, and a WARNING per module that looks like an MLP
    but got the generic form, with the reason (which names the fix)."""
    description = _described(model, DEFAULT_DESCRIBE_TOKENS)
    log.info("%s", description.summary())
    for name, module, state, _ in tiled_states(model):
        if state.warn:
            log.warning("%s (%s) takes the generic form, which recomputes the whole module per shard: %s",
                        name or "<root>", type(module).__name__, state.reason)
