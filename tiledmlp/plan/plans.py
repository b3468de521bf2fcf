""":func:`plan_memory` (a step's memory on this rank for a length: its terms, peaks, placement, whether it fits and the
longest length that does), the budgets a plan is held to, and the placement ``offload="auto"`` executes."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch import nn

from ..core.compat import checkpointing_call
from ..core.logs import warn_once
from ..core.regions import ATTENTION
from ..distributed.sequence_parallel import split_of
from ..offload.checkpointing import pinned_bytes
from ..offload.host_memory import available_host_bytes
from .memory import GPU, HOST, RECOMPUTE, Peak, StepOptions, place
from .shapes import ModelShape, local_bytes, model_shape

__all__ = ["MemoryPlan", "plan_memory", "step_options", "AutoPlacement", "budgets", "refusal", "options_for_length",
           "ESCALATION", "OPTIONS_ATTR"]

log = logging.getLogger("tiledmlp")

#: where ``enable_tiling`` leaves the options a model was tiled with (``plan_memory`` of a tiled model reads them)
OPTIONS_ATTR = "_tiledmlp_step_options"
GPU_MARGIN = (1 << 30, 0.03)  # left free on the device: the larger of 1 GiB and 3% (CUDA workspaces, fragmentation)
HOST_MARGIN = 2 << 30  # left free on the host for everything else
#: the enable_tiling options plan_memory takes; ``projections`` only to say that its terms are not modelled (its LoRA
#: copies add per-token terms not measured on this version: the plan may be low, and says so)
PLANNED_OPTIONS = ("loss", "norms", "attention", "offload", "loss_scratch_mib", "scratch_mib", "projections")
UNMODELLED_PROJECTIONS = ("projections=True: the LoRA projections' per-token copies (their inputs, cast or not) are "
                          "not in this plan, so the device peak may be higher than planned; with offload='auto' give "
                          "gpu_mib with room to spare, or use offload='cpu'")
_LONGEST = 1 << 26  # local tokens: the longest length searched
_GRAIN = 1024  # longest lengths are multiples of this many local tokens


def _gib(nbytes: Optional[float]) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


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

    @property
    def gpu_peak_bytes(self) -> int:
        return self.peak.gpu_bytes

    @property
    def host_peak_bytes(self) -> int:
        return self.peak.host_bytes

    @property
    def fits(self) -> bool:
        return ((self.gpu_budget_bytes is None or self.gpu_peak_bytes <= self.gpu_budget_bytes)
                and (self.host_budget_bytes is None or self.host_peak_bytes <= self.host_budget_bytes))

    def placed(self) -> str:
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
                 f"{'fits' if self.fits else 'does NOT fit'}; longest {self.longest_seq_len:,} tokens",
                 f"  layer inputs: {self.placed() or 'no checkpointed layers'}",
                 f"  device peak {_gib(self.gpu_peak_bytes)} {self.peak.moment} "
                 f"(budget {_gib(self.gpu_budget_bytes)}); "
                 f"host {_gib(self.host_peak_bytes)} pinned (budget {_gib(self.host_budget_bytes)})"]
        if o.projections:
            lines.append(f"  not modelled: {UNMODELLED_PROJECTIONS}")
        width = max(len(t.name) for t in self.peak.terms)
        lines += [f"    {t.where:<4}  {t.name:<{width}}  {_gib(t.nbytes):>11}  {t.note}".rstrip()
                  for t in self.peak.terms]
        return "\n".join(lines)

    __str__ = table


def step_options(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                 **options: Any) -> StepOptions:
    """The memory-relevant options: those given, else those ``model`` was tiled with, else ``enable_tiling``'s
    defaults; ``optimizer``'s state bytes on this rank (its states when it has stepped, else Adam's two per element,
    SGD's momentum)."""
    tiled = model.__dict__.get(OPTIONS_ATTR) or StepOptions()
    loss = options.get("loss", tiled.loss)
    scratch_mib = options.get("loss_scratch_mib")
    step = replace(tiled, loss=loss is not False, norms=bool(options.get("norms", tiled.norms)),
                   attention=bool(options.get("attention", tiled.attention)),
                   offload=options.get("offload", tiled.offload),
                   scratch_mib=options.get("scratch_mib", tiled.scratch_mib),
                   projections=bool(options.get("projections", tiled.projections)),
                   **({"loss_scratch_bytes": int(scratch_mib * 2**20)} if scratch_mib else {}))
    if step.offload not in (None, "cpu", "auto"):
        raise ValueError(f"offload={step.offload!r}: plan_memory plans offload=None, 'cpu' or 'auto'")
    return replace(step, optimizer_bytes=_optimizer_bytes(optimizer)) if optimizer is not None else step


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    states = sum(local_bytes(t) for state in optimizer.state.values() for t in state.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0)
    if states:
        return states
    params = sum(local_bytes(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad)
    if isinstance(optimizer, torch.optim.SGD):
        return params if any(group.get("momentum") for group in optimizer.param_groups) else 0
    if "adam" not in type(optimizer).__name__.lower():
        warn_once(("optimizer assumed", type(optimizer).__name__), "plan_memory: %s has no state yet; its states are "
                  "assumed to take two elements per parameter element (as Adam's)", type(optimizer).__name__)
    return 2 * params


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def budgets(model: nn.Module, gpu_mib: Optional[float] = None,
            host_mib: Optional[float] = None) -> tuple[Optional[int], Optional[int]]:
    """``(device, host)`` bytes a step may take: those given, else what this process may use now, minus margins:
    the device's free memory plus what this process's allocator holds (None on a CPU: its memory is the host's), this
    process's share of the host's available memory (control-group aware; shared evenly by the ``LOCAL_WORLD_SIZE``
    ranks a launcher started on this host) plus the offload buffers this process already holds."""
    device = _device_of(model)
    gpu = int(gpu_mib * 2**20) if gpu_mib is not None else None
    if gpu is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        gpu = free + torch.cuda.memory_reserved(device) - max(GPU_MARGIN[0], int(GPU_MARGIN[1] * total))
    host = int(host_mib * 2**20) if host_mib is not None else None
    if host is None:
        available = available_host_bytes()
        # the buffers this process already pinned for offload serve the next steps too
        share = None if available is None else max(available - HOST_MARGIN, 0) // _ranks_on_this_host()
        host = None if share is None else share + pinned_bytes(device)
    return gpu, host


def _ranks_on_this_host() -> int:
    """The processes a launcher started on this host (torchrun, accelerate and SLURM's torchrun set
    ``LOCAL_WORLD_SIZE``), each planning its own steps: they share the host's memory."""
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


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
          host: Optional[int]) -> MemoryPlan:
    tokens = seq_len * batch_size // split
    options = replace(options, ulysses=split if options.ulysses > 1 else 1)
    if options.projections:
        warn_once(("plan without projections",), "plan_memory: %s", UNMODELLED_PROJECTIONS)
    (places, keeps), peak = place(shape, options, tokens, gpu, host)
    longest = longest_tokens(shape, options, gpu, host) * split // batch_size
    return MemoryPlan(seq_len, batch_size, tokens, options, places, keeps, peak, gpu, host, longest)


def plan_memory(model: nn.Module, seq_len: int, *, batch_size: int = 1, sequence_parallel: int = 1,
                optimizer: Optional[torch.optim.Optimizer] = None, gpu_mib: Optional[float] = None,
                host_mib: Optional[float] = None, **options: Any) -> MemoryPlan:
    """The memory of one training step of ``model`` (a Hugging Face causal LM with checkpointed layers, bare or
    wrapped, tiled or not) for ``batch_size`` sequences of ``seq_len`` tokens, split over ``sequence_parallel``
    ranks (DeepSpeed's Ulysses, whose attention ``attention=True`` computes with ``tiledmlp.attention.ulysses``; a
    model split by torch's ring, ``split_of`` ``"cp"``, is planned by its local tokens only, a projection no
    measurement checked): per rank, the device and host peaks and their terms, the placement of each checkpointed
    layer's input (``offload="auto"``: kept, host or recomputed, see ``tiledmlp.plan.memory``), whether it fits
    ``gpu_mib`` / ``host_mib`` (default: those ``model`` was tiled with, else what this process may use now) and the
    longest length that does; under ``offload="auto"``, which layers keep their attention output for the recompute
    with what the device budget has left (``tiledmlp.plan.memory``, design note "free memory spent on speed").

    ``options``: ``enable_tiling``'s (``loss``, ``norms``, ``attention``, ``offload``, ``loss_scratch_mib``,
    ``scratch_mib``, ``projections``); those left out are the ones ``model`` was tiled with, else the defaults.
    ``projections=True``'s LoRA copies are not modelled: such a plan says so in its table and in a warning, once.
    ``optimizer``: count its states. Runs nothing on the model; costs no communication."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int (tokens per sequence), got {seq_len!r}")
    if batch_size < 1 or sequence_parallel < 1 or seq_len * batch_size % sequence_parallel:
        raise ValueError(f"batch_size ({batch_size}) and sequence_parallel ({sequence_parallel}) must be positive, "
                         "and the batch's tokens must split evenly over the sequence-parallel ranks")
    unknown = sorted(set(options) - set(PLANNED_OPTIONS))
    if unknown:
        raise TypeError(f"plan_memory got {unknown}; it takes the enable_tiling options that change its terms: "
                        f"{list(PLANNED_OPTIONS)}")
    shape = model_shape(model)
    if not shape.checkpointed:
        raise ValueError(f"plan_memory models a decoder with checkpointed layers, and no module of "
                         f"{type(model).__name__} checkpoints: call {checkpointing_call(model)} first")
    step = step_options(model, optimizer, **options)
    split = split_of(model)
    step = replace(step, ulysses=sequence_parallel if split is None or split.kind == "sp" else 1)
    gpu, host = budgets(model, step.gpu_mib if gpu_mib is None else gpu_mib,
                        step.host_mib if host_mib is None else host_mib)
    return _plan(shape, step, seq_len, batch_size, sequence_parallel, gpu, host)


def refusal(plan: MemoryPlan, shape: ModelShape) -> str:
    """Why ``plan`` cannot run, the longest length that can, and which options would make its length fit."""
    o, helps = plan.options, []
    for change in ({"offload": "auto"}, {"attention": True}, {"norms": True}, {"loss": True}):
        key, value = next(iter(change.items()))
        if getattr(o, key) == value:
            continue
        if _fits(shape, replace(o, **change), plan.tokens, plan.gpu_budget_bytes, plan.host_budget_bytes):
            helps.append(f"{key}={value!r}")
    return (f"a step of {plan.seq_len:,} tokens x {plan.batch_size} needs {_gib(plan.gpu_peak_bytes)} of device "
            f"memory (budget {_gib(plan.gpu_budget_bytes)}) and {_gib(plan.host_peak_bytes)} of host memory (budget "
            f"{_gib(plan.host_budget_bytes)}) with {plan.placed()}. The longest that fits is "
            f"{plan.longest_seq_len:,} tokens" + (f"; {' or '.join(helps)} would make this length fit" if helps else
                                                 "; fewer tokens per step, more ranks for the sequence, or more memory "
                                                 "(gpu_mib/host_mib) would"))


#: what ``enable_tiling(model, seq_len=T)`` turns on, in this order, until the step fits: the cheapest first (tiled
#: norms cost one more norm forward per shard; ``attention=True`` nothing measurable; offloading host copies or
#: layer recomputes). ``offload="auto"`` comes on last in any case, where not given: it spends what is left of the
#: device on speed
ESCALATION = (("norms", True), ("attention", True), ("offload", "auto"))


def options_for_length(model: nn.Module, seq_len: int, given: dict[str, Any], gpu_mib: Optional[float] = None,
                       host_mib: Optional[float] = None) -> tuple[dict[str, Any], MemoryPlan, list[str]]:
    """The options of ``enable_tiling`` for steps of ``seq_len`` tokens: those ``given``, and of the others the
    fewest of :data:`ESCALATION` with which the plan fits the budgets. Returns them, their plan, and what was turned
    on. ValueError, with the longest length that fits and what else would help, when nothing fits."""
    chosen = {"loss": given.get("loss") is not False, "norms": given.get("norms", False),
              "attention": given.get("attention", False), "offload": given.get("offload"),
              "projections": given.get("projections", False)}
    plan = plan_memory(model, seq_len, gpu_mib=gpu_mib, host_mib=host_mib, **chosen)
    turned_on = []
    for key, value in ESCALATION:
        if plan.fits:
            break
        if key in given or chosen[key] == value:
            continue
        chosen[key] = value
        turned_on.append(f"{key}={value!r}")
        plan = plan_memory(model, seq_len, gpu_mib=gpu_mib, host_mib=host_mib, **chosen)
    if not plan.fits:
        raise ValueError(f"enable_tiling(seq_len={seq_len}): {refusal(plan, model_shape(model))}")
    if "offload" not in given and chosen["offload"] is None:
        chosen["offload"] = "auto"  # fits as it is: the rest of the device is spent on speed
        plan = plan_memory(model, seq_len, gpu_mib=gpu_mib, host_mib=host_mib, **chosen)
    return chosen, plan, turned_on


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
        plan = _plan(shape, replace(self.options, optimizer_bytes=other, ulysses=ulysses), tokens * ulysses, 1,
                     ulysses, gpu, host)
        if not plan.fits:
            raise MemoryError(f"tiledmlp offload='auto': {refusal(plan, shape)}")
        log.info("offload='auto' at %s tokens: layer inputs %s; device peak ~%s, host %s", f"{tokens:,}",
                 plan.placed(), _gib(plan.gpu_peak_bytes), _gib(plan.host_peak_bytes))
        return plan.placement, tuple(frozenset((ATTENTION,)) if k else frozenset() for k in plan.attention_kept)


def _other_device_bytes(model: nn.Module) -> int:
    """What this process has allocated on the model's device besides the weights and gradients (the optimizer's
    states, the inputs): counted as a constant of the step; 0 on a CPU."""
    device = _device_of(model)
    if device.type != "cuda":
        return 0
    params = list(dict.fromkeys(model.parameters()))
    model_bytes = sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0) for p in params)
    return max(torch.cuda.memory_allocated(device) - model_bytes, 0)
