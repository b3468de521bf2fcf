""":class:`TilingOptions`: every option of ``enable_tiling`` in one frozen object, checked once when it is made; the
option names every caller reads (derived from its fields, never written out again); and the one accessor of the
options a tiled model was tiled with (:func:`tiling_options_of`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, NamedTuple, Optional

import torch
from torch import nn

from ..core.accumulate import check_accum_dtype
from ..core.sharding import LOSS_MODES, ShardPolicy, check_mib
from ..distributed.selection import STRATEGY_NAMES
from .arguments import check_flag, check_loss, check_loss_off, check_offload, check_optimizer
from .memory import StepOptions

__all__ = ["TilingOptions", "OPTION_NAMES", "PLANNED_OPTIONS", "LENGTH_OPTIONS", "PLAN_INPUTS", "ASSUMED_OPTIONS",
           "SWITCHES", "FORMS", "tiling_options_of", "tiled_step_options", "remember_options", "forget_options"]

FORMS = ("auto", "generic")
#: where ``enable_tiling`` leaves the options a model was tiled with (read by :func:`tiling_options_of` only)
_ATTR = "_tiledmlp_step_options"
_PLANNED, _LENGTH, _INPUT, _ASSUMED = "planned", "length", "input", "assumed"


class _Default:
    """The default of a memory option ``seq_len`` chooses where it is not given: ``value`` without ``seq_len``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"{self.value!r} (or seq_len's choice)"


def _option(default: Any, *groups: str) -> Any:
    return field(default=default, metadata={"groups": frozenset(groups)})


@dataclass(frozen=True, kw_only=True)
class TilingOptions:
    """What ``enable_tiling(model, **options)`` takes, as one object: ``enable_tiling(model, options=...)``,
    ``plan_memory(model, seq_len, options=...)``. Made once, checked once: a wrong type is a ``TypeError``, a wrong
    value a ``ValueError``, each naming the field and what it takes. ``norms``, ``attention`` and ``offload`` not given
    are chosen by ``seq_len``'s plan (``dataclasses.replace`` gives every field). Memory and speed of each option:
    ``docs/api.md``, "enable_tiling's options"."""

    #: ``"auto"`` (detect the wrapper, also at run time) or a forced one of ``STRATEGY_NAMES``; costs nothing
    strategy: str = "auto"
    #: shards per call; None: the automatic policy (fewest shards whose backward scratch fits ``scratch_mib``)
    num_shards: Optional[int] = None
    #: tile the LM head + cross-entropy: None where it can, True everywhere (or a ValueError), False MLPs only
    loss: Optional[bool] = _option(None, _PLANNED, _LENGTH, _ASSUMED)
    #: tokens per shard instead of a count (fixed scratch memory per shard)
    tile_tokens: Optional[int] = None
    #: blocks of the intermediate dimension per shard in the fast forms' backward (scratch / blocks); None: automatic
    inter_chunks: Optional[int] = None
    #: backward scratch budget of the fast forms in MiB (None: 512): the speed/memory knob of the automatic policy
    scratch_mib: Optional[float] = _option(None, _PLANNED)
    #: ``"auto"`` (the fast form where the probe finds one) or ``"generic"`` (the module's own forward, slower)
    form: str = "auto"
    #: how shard gradients are summed: None (bf16 in block-scaled float16, 2 bytes), torch.float32 (exact, 4 bytes)
    grad_accum_dtype: Optional[torch.dtype] = None
    #: extra nn.Module types tiled with the generic form (a list or tuple of classes; kept as a tuple)
    mlp_types: tuple[type, ...] = ()
    #: tile MoE blocks (their experts, the router run once)
    include_moe: bool = True
    #: the tiled loss's scratch budget in MiB (None: the larger of 256 MiB and the hidden states' size)
    loss_scratch_mib: Optional[float] = _option(None, _PLANNED)
    #: ``"auto"``, ``"fused"`` (no logits recompute) or ``"recompute"`` (vocabulary chunks recomputed in backward)
    loss_mode: str = "auto"
    #: how the head gradient's shard partials are summed: torch.float32 (exact) or None (block-scaled float16)
    loss_grad_accum_dtype: Optional[torch.dtype] = torch.float32
    #: tile normalization layers: only their input kept for backward; one more norm forward per shard in backward
    norms: bool = _option(_Default(False), _PLANNED, _LENGTH, _ASSUMED)
    #: the attention core's backward in groups of KV heads (fewer bytes per token, no more FLOPs)
    attention: bool = _option(_Default(False), _PLANNED, _LENGTH, _ASSUMED)
    #: checkpointed layers' inputs: None (kept), ``"cpu"`` (pinned host memory, side-stream copies), ``"auto"`` (plan)
    offload: Optional[str] = _option(_Default(None), _PLANNED, _LENGTH, _ASSUMED)
    #: tile peft LoRA layers outside the MLPs and heads (q, k, v, o): their per-token copies one shard at a time
    projections: bool = _option(False, _PLANNED, _LENGTH)
    #: ``offload="auto"``'s device budget for one step in MiB (None: what the process may use)
    gpu_mib: Optional[float] = _option(None, _INPUT)
    #: ``offload="auto"``'s host budget for one step in MiB (None: available host memory, control-group aware)
    host_mib: Optional[float] = _option(None, _INPUT)
    #: tokens per step to plan for: the memory options not given are the fastest that fit (checkpointing needed)
    seq_len: Optional[int] = _option(None, _INPUT)
    #: the optimizer the plan counts: an optimizer object or a name (``"adamw"``, ``"adamw8bit"``, Trainer ``optim``)
    optimizer: Any = _option(None, _LENGTH)
    #: where its memory lives: ``"gpu"``, ``"backward"`` (stepped in backward), ``"host"``; None: where it is/fastest
    optimizer_placement: Optional[str] = _option(None, _LENGTH)
    #: the options among ``norms``, ``attention``, ``offload`` that were not given (``seq_len``'s plan chooses them)
    left_to_plan: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        unset = frozenset(f.name for f in fields(self) if f.init and isinstance(getattr(self, f.name), _Default))
        for name in unset:
            object.__setattr__(self, name, getattr(self, name).value)
        object.__setattr__(self, "left_to_plan", unset)
        object.__setattr__(self, "mlp_types", _mlp_types(self.mlp_types))
        self._check_memory_options()
        if self.seq_len is not None and (isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int)
                                         or self.seq_len < 1):
            raise ValueError(f"seq_len must be a positive int (tokens per step to plan for) or None, got "
                             f"{self.seq_len!r}")
        if self.strategy not in STRATEGY_NAMES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of {list(STRATEGY_NAMES)}")
        if self.form not in FORMS:
            raise ValueError(f"unknown form {self.form!r}; choose one of {list(FORMS)}")
        check_accum_dtype(self.grad_accum_dtype, "grad_accum_dtype")
        self.shard_policy()  # num_shards, tile_tokens, inter_chunks and scratch_mib, as the policy takes them
        if self.loss_mode not in LOSS_MODES:
            raise ValueError(f"unknown loss_mode {self.loss_mode!r}; choose one of {list(LOSS_MODES)}")
        check_accum_dtype(self.loss_grad_accum_dtype, "loss_grad_accum_dtype")

    def _check_memory_options(self) -> None:
        """The options that change a step's memory (``tiledmlp.plan.arguments``), as ``plan_memory`` checks them."""
        check_loss(self.loss)
        for name in SWITCHES:
            if name != "loss":  # None too: check_loss
                check_flag(name, getattr(self, name))
        check_offload(self.offload)
        for name in ("gpu_mib", "host_mib"):
            check_mib(name, getattr(self, name), zero_allowed=True, none_means="what this process may use")
        for name in ("scratch_mib", "loss_scratch_mib"):
            check_mib(name, getattr(self, name))
        if self.loss is False:
            check_loss_off({f.name: (getattr(self, f.name), f.default) for f in fields(self)
                            if f.name.startswith("loss_")})
        check_optimizer(self.optimizer, self.optimizer_placement)

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any], call: str = "enable_tiling") -> "TilingOptions":
        """The options ``call`` was given as keywords: a ``TypeError`` listing the valid ones for one not taken."""
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"{call} got unknown options {unknown}; valid options: {list(OPTION_NAMES)}")
        return cls(**options)

    def given(self) -> dict[str, Any]:
        """The options given: those not at their default, and those of ``norms``, ``attention``, ``offload`` that
        are not :attr:`left_to_plan` (as ``enable_tiling``'s keywords, those left out being the defaults)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init and (
            f.name not in self.left_to_plan if isinstance(f.default, _Default) else
            not _same(getattr(self, f.name), f.default))}

    def shard_policy(self) -> ShardPolicy:
        """How the tokens of one call are cut (``tiledmlp.core.sharding``)."""
        return ShardPolicy(num_shards=self.num_shards, tile_tokens=self.tile_tokens, inter_chunks=self.inter_chunks,
                           scratch_mib=self.scratch_mib)


def _same(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def _mlp_types(value: Any) -> tuple[type, ...]:
    """``mlp_types`` as a tuple of ``nn.Module`` subclasses (``TypeError`` naming the option otherwise)."""
    if isinstance(value, type) or not isinstance(value, (list, tuple, set, frozenset)):
        raise TypeError(f"mlp_types must be a list of nn.Module subclasses, got {value!r}"
                        + (f" (a class itself: pass [{value.__name__}])" if isinstance(value, type) else ""))
    types = tuple(value)
    if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise TypeError(f"mlp_types must be a list of nn.Module subclasses, got {types!r}")
    return types


def _names(group: Optional[str] = None) -> tuple[str, ...]:
    return tuple(f.name for f in fields(TilingOptions)
                 if f.init and (group is None or group in f.metadata.get("groups", ())))


#: every option ``enable_tiling`` takes, in the order of :class:`TilingOptions`' fields (the one list of them)
OPTION_NAMES = _names()
#: the options that change ``plan_memory``'s terms (``projections`` only to say its terms are not modelled)
PLANNED_OPTIONS = _names(_PLANNED)
#: the options ``seq_len``'s plan takes as given (``tiledmlp.plan.choose``)
LENGTH_OPTIONS = _names(_LENGTH)
#: the on/off memory options a plan says it assumed, and where from (its table's ``options:`` line)
ASSUMED_OPTIONS = _names(_ASSUMED)
#: the options that say what the plan is for (the length, the budgets), not how a module is tiled
PLAN_INPUTS = _names(_INPUT)
#: the options that are True or False (``loss`` None too: its default)
SWITCHES = tuple(f.name for f in fields(TilingOptions) if f.type in ("bool", "Optional[bool]"))


class _Tiled(NamedTuple):
    options: TilingOptions
    step: StepOptions


def remember_options(model: nn.Module, options: TilingOptions, step: StepOptions) -> None:
    """Keep on ``model`` the options it was tiled with and the memory terms they make (``enable_tiling``). An
    optimizer object is not kept (its memory is in ``step``): the model would hold it, and each copy or pickle of the
    model would carry the optimizer and its states."""
    if options.optimizer is not None and not isinstance(options.optimizer, str):
        options = replace(options, optimizer=None, optimizer_placement=None)
    model.__dict__[_ATTR] = _Tiled(options, step)


def forget_options(model: nn.Module) -> None:
    model.__dict__.pop(_ATTR, None)


def tiling_options_of(model: nn.Module) -> Optional[TilingOptions]:
    """The options ``enable_tiling`` last tiled ``model`` with, those ``seq_len`` chose filled in (None: not tiled); an
    optimizer given as an object is not among them (:func:`remember_options`)."""
    tiled = model.__dict__.get(_ATTR)
    return tiled.options if tiled is not None else None


def tiled_step_options(model: nn.Module) -> Optional[StepOptions]:
    """The memory terms of the options ``model`` was tiled with (the optimizer's bytes as counted then, why
    ``seq_len`` chose them), as ``plan_memory`` takes them for the options not given (None: not tiled)."""
    tiled = model.__dict__.get(_ATTR)
    return tiled.step if tiled is not None else None
