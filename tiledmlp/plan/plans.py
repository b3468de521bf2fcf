""":func:`plan_memory` (a step's memory on this rank for a length: its terms, peaks, placement, whether it fits and the
longest length that does), the budgets a plan is held to, and the placement ``offload="auto"`` executes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch import nn

from ..core.compat import checkpointing_call
from ..core.logs import warn_once
from ..core.regions import ATTENTION
from ..distributed.sequence_parallel import split_of
from .budgets import budgets
from .memory import GPU, HOST, RECOMPUTE, Peak, StepOptions
from .optimizer import OptimizerMemory, engine_placement, optimizer_memory, placements_for
from .options import ASSUMED_OPTIONS, PLANNED_OPTIONS, TilingOptions, tiled_step_options
from .placement import place
from .shapes import ModelShape, compute_device, device_bytes, model_shape

__all__ = ["MemoryPlan", "plan_memory", "plan_for_shape", "step_options", "AutoPlacement", "refusal"]

log = logging.getLogger("tiledmlp")

#: ``projections=True``'s LoRA copies add per-token terms not measured on this version: the plan may be low, and says so
UNMODELLED_PROJECTIONS = ("projections=True: the LoRA projections' per-token copies (their inputs, cast or not) are "
                          "not in this plan, so the device peak may be higher than planned; with offload='auto' give "
                          "gpu_mib with room to spare, or use offload='cpu'")
_LONGEST = 1 << 26  # local tokens: the longest length searched
_GRAIN = 1024  # longest lengths are multiples of this many local tokens


def _gib(nbytes: Optional[float]) -> str:
    """Bytes in the unit that shows them: GiB from 1 GiB, MiB below."""
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**30:.2f} GiB" if abs(nbytes) >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class MemoryPlan:
    """One training step of ``seq_len`` tokens per sequence (``batch_size`` sequences; ``tokens`` of them on this
    rank after a split sequence) under ``options``: the placement of each checkpointed layer's input, the device and
    host peaks with their terms, the budgets, whether it fits them and the longest ``seq_len`` that does."""

    seq_len: int
    batch_size: int
    tokens: int
    options: StepOptions
    placement: tuple[str, ...]
    attention_kept: tuple[bool, ...]  # per checkpointed layer: its attention output kept for its recompute
    peak: Peak
    gpu_budget_bytes: Optional[int]
    host_budget_bytes: Optional[int]
    longest_seq_len: int
    optimizer_choice: str = ""  # why the optimizer is placed where it is, when the plan chose it
    longest_placement: str = ""  # the optimizer placement the longest length needs, where not this plan's
    checkpointed: bool = True  # the model's layers checkpoint (else each keeps its activations: not measured)
    assumed: str = ""  # which options the plan took from where: given, the model's own (enable_tiling), the defaults
    would_fit: str = ""  # where it does not fit: the options that would make this length fit

    @property
    def optimizer(self) -> OptimizerMemory:
        """The optimizer counted (``optimizer.spec`` None: none), its bytes and placement."""
        return self.options.optimizer

    @property
    def gpu_peak_bytes(self) -> int:
        return self.peak.gpu_bytes

    @property
    def host_peak_bytes(self) -> int:
        return self.peak.host_bytes

    @property
    def fits(self) -> bool:
        """Within both budgets, and no longer than the longest length (searched up to 64M local tokens: a length
        beyond that is not said to fit, whatever the budgets)."""
        return ((self.gpu_budget_bytes is None or self.gpu_peak_bytes <= self.gpu_budget_bytes)
                and (self.host_budget_bytes is None or self.host_peak_bytes <= self.host_budget_bytes)
                and self.seq_len <= self.longest_seq_len)

    def placed(self) -> str:
        if not self.checkpointed:
            return f"none checkpointed: each of {len(self.placement)} layers keeps its activations"
        counts = {p: self.placement.count(p) for p in (GPU, HOST, RECOMPUTE)}
        kept = sum(self.attention_kept)
        return ", ".join(f"{n} {where}" for where, n in (("kept on the device", counts[GPU]),
                                                          ("on the host", counts[HOST]),
                                                          ("recomputed", counts[RECOMPUTE])) if n) + (
            f"; attention output kept for the recompute in {kept}" if kept else "")

    def table(self) -> str:
        o = self.options
        lines = [f"memory plan: {self.seq_len:,} tokens x {self.batch_size} ({self.tokens:,} on this rank), "
                 f"loss={o.loss}, norms={o.norms}, attention={o.attention}, offload={o.offload!r}: "
                 f"{'fits' if self.fits else 'does NOT fit'}; longest {self.longest_seq_len:,} tokens"
                 + (f" (with the optimizer '{self.longest_placement}')" if self.longest_placement else ""),
                 *([f"  options: {self.assumed}"] if self.assumed else []),
                 f"  layer inputs: {self.placed() or 'no checkpointed layers'}",
                 f"  optimizer: {o.optimizer.label()}"
                 + (f"; {self.optimizer_choice}" if self.optimizer_choice else ""),
                 f"  device peak {_gib(self.gpu_peak_bytes)} {self.peak.moment} "
                 f"(budget {_gib(self.gpu_budget_bytes)}); "
                 f"host {_gib(self.host_peak_bytes)} pinned (budget {_gib(self.host_budget_bytes)})"]
        if o.projections:
            lines.append(f"  not modelled: {UNMODELLED_PROJECTIONS}")
        if not self.fits:
            lines.append("  to fit: " + (self.would_fit or "fewer tokens per step, more ranks for the sequence, or "
                                         "more memory (gpu_mib/host_mib)"))
        if self.placement and not self.checkpointed:
            lines.append("  not measured: a model without checkpointing keeps each layer's activations (counted as "
                         "what a layer's recompute would rebuild); enable_tiling(model, seq_len=T) turns checkpointing "
                         "on where it does not fit without")
        width = max(len(t.name) for t in self.peak.terms)
        lines += [f"    {t.where:<4}  {t.name:<{width}}  {_gib(t.nbytes):>11}  {t.note}".rstrip()
                  for t in self.peak.terms]
        return "\n".join(lines)

    __str__ = table


def step_options(model: nn.Module, optimizer: Any = None, optimizer_placement: Optional[str] = None,
                 **options: Any) -> StepOptions:
    """The memory-relevant options: those given (checked by the callers as ``TilingOptions``), else those
    ``model`` was tiled with, else ``enable_tiling``'s defaults; ``optimizer``'s bytes on this rank
    (``tiledmlp.plan.optimizer``: an optimizer object, or a name placed at ``optimizer_placement``, default
    ``"gpu"``), or the engine's offload the model is wrapped with."""
    tiled = tiled_step_options(model) or StepOptions()
    loss = options.get("loss", tiled.loss)
    scratch_mib = options.get("loss_scratch_mib")
    step = replace(tiled, loss=loss is not False, norms=bool(options.get("norms", tiled.norms)),
                   attention=bool(options.get("attention", tiled.attention)),
                   offload=options.get("offload", tiled.offload),
                   scratch_mib=options.get("scratch_mib", tiled.scratch_mib),
                   projections=bool(options.get("projections", tiled.projections)),
                   **({"loss_scratch_bytes": int(scratch_mib * 2**20)} if scratch_mib else {}))
    engine = engine_placement(model)
    if optimizer is None and engine is None:
        return step
    return replace(step, optimizer=optimizer_memory(model, optimizer, optimizer_placement, engine))


def _fits(shape: ModelShape, options: StepOptions, tokens: int, gpu: Optional[int], host: Optional[int]) -> bool:
    _, peak = place(shape, options, tokens, gpu, host, spend=False)
    return (gpu is None or peak.gpu_bytes <= gpu) and (host is None or peak.host_bytes <= host)


def longest_tokens(shape: ModelShape, options: StepOptions, gpu: Optional[int], host: Optional[int]) -> int:
    """The most local tokens (a multiple of 1024) a step may have within the budgets; 0 if none fits."""
    low, high = 0, _GRAIN
    while high <= _LONGEST and _fits(shape, options, high, gpu, host):
        low, high = high, high * 2
    if high > _LONGEST:
        return low
    while high - low > _GRAIN:
        middle = (low + high) // 2 // _GRAIN * _GRAIN
        low, high = (middle, high) if _fits(shape, options, middle, gpu, host) else (low, middle)
    return low


def _plan(shape: ModelShape, options: StepOptions, seq_len: int, batch_size: int, split: int, gpu: Optional[int],
          host: Optional[int], optimizer_choice: str = "", assumed: str = "") -> MemoryPlan:
    tokens = seq_len * batch_size // split
    options = replace(options, ulysses=split if options.ulysses > 1 else 1)
    if options.projections:
        warn_once(("plan without projections",), "plan_memory: %s", UNMODELLED_PROJECTIONS)
    (places, keeps), peak = place(shape, options, tokens, gpu, host)
    longest = longest_tokens(shape, options, gpu, host) * split // batch_size
    within = (gpu is None or peak.gpu_bytes <= gpu) and (host is None or peak.host_bytes <= host)
    if within and tokens <= _LONGEST:  # the search's grain of 1024 tokens must not call a fitting length too long
        longest = max(longest, seq_len)
    plan = MemoryPlan(seq_len, batch_size, tokens, options, places, keeps, peak, gpu, host, longest,
                      optimizer_choice, checkpointed=bool(shape.checkpointed), assumed=assumed)
    return plan if plan.fits else replace(plan, would_fit=_would_fit(plan, shape))


def _assumed(model: nn.Module, step: StepOptions, given: dict[str, Any]) -> str:
    """Each memory option of ``step`` and where the plan took it from: given, the model's own (as ``enable_tiling``
    tiled it), or the default."""
    tiled = tiled_step_options(model)
    source = "as tiled" if tiled is not None else "default"
    said = ", ".join(f"{key}={getattr(step, key)!r} ({'given' if key in given else source})"
                     for key in ASSUMED_OPTIONS)
    return said + (f"; tiled for {tiled.chosen_because}" if tiled is not None and tiled.chosen_because else "")


def _placed_optimizer(model: nn.Module, step: StepOptions, optimizer: Any, placements: tuple[str, ...],
                      plan_one: Any) -> MemoryPlan:
    """The plan with ``optimizer`` at the first of ``placements`` (fastest first) with which the step fits (else the
    last), and, where there was a choice, why there, in one phrase."""
    plans = [plan_one(replace(step, optimizer=optimizer_memory(model, optimizer, p))) for p in placements]
    if len(plans) == 1:
        return plans[0]
    chosen = next((i for i, plan in enumerate(plans) if plan.fits), len(plans) - 1)
    tried = [f"{_gib(plan.gpu_peak_bytes)} of device and {_gib(plan.host_peak_bytes)} of host memory with the "
             f"optimizer '{placement}'" for placement, plan in zip(placements, plans)][:chosen + 1]
    why = (f"placed '{placements[0]}', the fastest" if chosen == 0 else
           f"placed '{placements[chosen]}': the step needs " + "; ".join(tried[:-1]))
    # the longest length is the longest any placement allows (a longer step moves the optimizer further)
    longest = max(plans, key=lambda plan: plan.longest_seq_len)
    return replace(plans[chosen], optimizer_choice=why if plans[chosen].fits else "no placement fits: " +
                   "; ".join(tried), longest_seq_len=longest.longest_seq_len, longest_placement=(
                       longest.optimizer.spec.placement if longest.longest_seq_len > plans[chosen].longest_seq_len
                       else ""))


def plan_memory(model: nn.Module, seq_len: int, *, batch_size: int = 1, sequence_parallel: int = 1,
                optimizer: Any = None, optimizer_placement: Optional[str] = None, gpu_mib: Optional[float] = None,
                host_mib: Optional[float] = None, options: Optional[TilingOptions] = None,
                **planned: Any) -> MemoryPlan:
    """The memory of one training step of ``model`` (a Hugging Face causal LM with checkpointed layers, bare or
    wrapped, tiled or not) for ``batch_size`` sequences of ``seq_len`` tokens, split over ``sequence_parallel``
    ranks (DeepSpeed's Ulysses, whose attention ``attention=True`` computes with ``tiledmlp.attention.ulysses``; a
    model split by torch's ring, ``split_of`` ``"cp"``, is planned by its local tokens only, a projection no
    measurement checked): per rank, the device and host peaks and their terms, the placement of each checkpointed
    layer's input (``offload="auto"``: kept, host or recomputed, see ``tiledmlp.plan.memory``), whether it fits
    ``gpu_mib`` / ``host_mib`` (default: those ``model`` was tiled with, else what this process may use now) and the
    longest length that does; under ``offload="auto"``, which layers keep their attention output for the recompute
    with what the device budget has left (``tiledmlp.plan.memory``, [Note: free memory spent on speed]).

    ``planned``: ``enable_tiling``'s options that change the terms (``loss``, ``norms``, ``attention``, ``offload``,
    ``loss_scratch_mib``, ``scratch_mib``, ``projections``: ``tiledmlp.plan.options.PLANNED_OPTIONS``); those left out
    are the ones ``model`` was tiled with (:func:`tiling_options_of`), else the defaults. Or ``options``, a
    :class:`TilingOptions` (what ``enable_tiling`` takes), read as the keywords it was given (``TilingOptions.given``:
    its fields at their defaults as keywords left out), with its ``optimizer``, ``optimizer_placement``, ``gpu_mib``
    and ``host_mib``; not both.
    ``projections=True``'s LoRA copies are not modelled: such a plan says so in its table and in a warning, once.
    ``optimizer``: count it (``tiledmlp.optimizers.spec``, [Note: what an optimizer holds, and when]: states, the step's
    temporaries, the gradients' lifetime, host copies): an optimizer object (placed as it is), or a name (``"adamw"``,
    torch's fused AdamW; ``"adamw-foreach"``; ``"adamw8bit"``; the Trainer's ``optim`` names) placed at
    ``optimizer_placement`` (``"gpu"``, ``"backward"``: stepped in backward, ``"host"``: torchao's CPU offload) or, by
    default, the fastest placement with which the step fits (``plan.optimizer_choice`` says why); an object on the
    device may be planned stepped in backward too (``step_in_backward`` makes it so). A model wrapped by an engine that
    offloads its optimizer (DeepSpeed ``offload_optimizer``, FSDP2 ``CPUOffloadPolicy``) is planned with the engine's
    placement. Without one, the plan counts no optimizer and its table says so. Runs nothing on the model; costs no
    communication."""
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("sequence_parallel", sequence_parallel)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if seq_len * batch_size % sequence_parallel:
        raise ValueError(f"the batch's {seq_len * batch_size} tokens must split evenly over the {sequence_parallel} "
                         "sequence-parallel ranks")
    if options is None:
        unknown = sorted(set(planned) - set(PLANNED_OPTIONS))
        if unknown:
            raise TypeError(f"plan_memory got {unknown}; it takes the enable_tiling options that change its terms: "
                            f"{list(PLANNED_OPTIONS)}")
        options = TilingOptions(**planned, optimizer=optimizer, optimizer_placement=optimizer_placement,
                                gpu_mib=gpu_mib, host_mib=host_mib)  # checked as enable_tiling checks them
    elif planned or any(v is not None for v in (optimizer, optimizer_placement, gpu_mib, host_mib)):
        raise TypeError("plan_memory takes the options as options=TilingOptions(...) or as keywords (norms=..., "
                        "optimizer=..., gpu_mib=...), not both: put them all in the TilingOptions")
    else:
        planned = {k: v for k, v in options.given().items() if k in PLANNED_OPTIONS}
    return plan_for_shape(model, model_shape(model), seq_len, batch_size, sequence_parallel, options.gpu_mib,
                          options.host_mib, {"optimizer": options.optimizer,
                                             "optimizer_placement": options.optimizer_placement}, planned)


def plan_for_shape(model: nn.Module, shape: ModelShape, seq_len: int, batch_size: int, sequence_parallel: int,
                   gpu_mib: Optional[float], host_mib: Optional[float], optimizer: dict[str, Any],
                   options: dict[str, Any]) -> MemoryPlan:
    """:func:`plan_memory` of ``model`` as ``shape`` says it is (checkpointed or not), its arguments checked."""
    optimizer_placement = optimizer.get("optimizer_placement")
    optimizer = optimizer.get("optimizer")
    placed = optimizer is not None and engine_placement(model) is None  # the engine's placement is its own
    placements = placements_for(optimizer, compute_device(model), optimizer_placement) if placed else ()
    step = step_options(model, optimizer, placements[0] if placed else None, **options)
    if step.offload is not None and not shape.checkpointed:
        raise ValueError(f"offload={step.offload!r} moves checkpointed layers' inputs, and no module of "
                         f"{type(model).__name__} checkpoints: call {checkpointing_call(model)} first, or plan "
                         "offload=None")
    split = split_of(model)
    step = replace(step, ulysses=sequence_parallel if split is None or split.kind == "sp" else 1)
    gpu, host = budgets(model, step.gpu_mib if gpu_mib is None else gpu_mib,
                        step.host_mib if host_mib is None else host_mib)

    assumed = _assumed(model, step, options)

    def plan_one(options: StepOptions) -> MemoryPlan:
        return _plan(shape, options, seq_len, batch_size, sequence_parallel, gpu, host, assumed=assumed)

    return _placed_optimizer(model, step, optimizer, placements, plan_one) if placed else plan_one(step)


def _would_fit(plan: MemoryPlan, shape: ModelShape) -> str:
    """The options, each turned on alone, that would make ``plan``'s length fit ("" if none would)."""
    o, helps = plan.options, []
    for key, value in (("offload", "auto"), ("attention", True), ("norms", True), ("loss", True)):
        if getattr(o, key) == value or (key == "offload" and not shape.checkpointed):
            continue
        if _fits(shape, replace(o, **{key: value}), plan.tokens, plan.gpu_budget_bytes, plan.host_budget_bytes):
            helps.append(f"{key}={value!r}")
    return f"{' or '.join(helps)} would make this length fit" if helps else ""


def refusal(plan: MemoryPlan, shape: ModelShape) -> str:
    """Why ``plan`` cannot run, the longest length that can, and which options would make its length fit."""
    return (f"a step of {plan.seq_len:,} tokens x {plan.batch_size} needs {_gib(plan.gpu_peak_bytes)} of device "
            f"memory (budget {_gib(plan.gpu_budget_bytes)}) and {_gib(plan.host_peak_bytes)} of host memory (budget "
            f"{_gib(plan.host_budget_bytes)}) with {plan.placed() or 'every layer kept'}. The longest that fits is "
            f"{plan.longest_seq_len:,} tokens" + (f"; {_would_fit(plan, shape)}" if _would_fit(plan, shape) else
                                                 "; fewer tokens per step, more ranks for the sequence, or more memory "
                                                 "(gpu_mib/host_mib) would"))


class AutoPlacement:
    """``offload="auto"``'s placement for a step whose layer input is ``nbytes`` (``tiledmlp.offload`` executes it,
    asking at each step's first layer): each layer's input place, and what its forward keeps for its recompute;
    planned from the model's shapes, the budgets, and what else is on the device
    then (optimizer states after the first step), once per length and such state; a length that fits nowhere is a
    ``MemoryError`` before the step's first layer, naming the longest that fits and what would help. Holds the model
    itself (not a closure), so that copies and pickles of the model keep working."""

    def __init__(self, model: nn.Module, options: StepOptions) -> None:
        self.model, self.options = model, options
        self._decided: dict[tuple[int, int], tuple[tuple[str, ...], tuple[frozenset[str], ...]]] = {}

    def __call__(self, nbytes: int) -> tuple[tuple[str, ...], tuple[frozenset[str], ...]]:
        # asked at the first layer, whose input (``nbytes``) is on the device now: the plan counts it itself
        other = max(_other_device_bytes(self.model) - nbytes, 0)
        key = (nbytes, other >> 28)  # what else is on the device, to 256 MiB
        if key not in self._decided:
            self._decided[key] = self._decide(nbytes, other)
        return self._decided[key]

    def _decide(self, nbytes: int, other: int) -> tuple[tuple[str, ...], tuple[frozenset[str], ...]]:
        shape = model_shape(self.model)
        tokens = nbytes // shape.layer_input_bytes_per_token
        gpu, host = budgets(self.model, self.options.gpu_mib, self.options.host_mib)
        split = split_of(self.model)
        ulysses = split.size if split is not None and split.kind == "sp" else 1
        # what else the device holds counts as a constant of the step; the optimizer's states are among it once
        # they exist (after its first step), else the plan adds them
        states = self.options.optimizer.device_states
        other = other - states if other >= states else other
        plan = _plan(shape, replace(self.options, other_device_bytes=other, ulysses=ulysses), tokens * ulysses, 1,
                     ulysses, gpu, host)
        if not plan.fits:
            raise MemoryError(f"tiledmlp offload='auto': {refusal(plan, shape)}")
        log.info("offload='auto' at %s tokens: layer inputs %s; device peak ~%s, host %s", f"{tokens:,}",
                 plan.placed(), _gib(plan.gpu_peak_bytes), _gib(plan.host_peak_bytes))
        return plan.placement, tuple(frozenset((ATTENTION,)) if k else frozenset() for k in plan.attention_kept)


def _other_device_bytes(model: nn.Module) -> int:
    """What this process has allocated on the model's device besides the weights and gradients (the optimizer's
    states, the inputs): counted as a constant of the step; 0 on a CPU."""
    device = compute_device(model)
    if device.type != "cuda":
        return 0
    params = list(dict.fromkeys(model.parameters()))
    model_bytes = sum(device_bytes(p) + (device_bytes(p.grad) if p.grad is not None else 0) for p in params)
    return max(torch.cuda.memory_allocated(device) - model_bytes, 0)
