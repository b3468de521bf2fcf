"""What :func:`enable_tiling` does to a model, in order: check the options, plan a tiling state per module
(``planning``), install the patched forwards (``patch``) and the follower of modules added later (``follow``), host
offload of checkpointed layers (``tiledmlp.offload``) and the attention blocks' mode (``tiledmlp.attention``), then
log what was tiled (``describe``); and its undo.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional

import torch
from torch import nn

from ..attention.layers import attention_scopes, install_attention, uninstall_attention
from ..core.compat import checkpointing_call, enable_checkpointing
from ..forms.kind import Kind
from ..distributed.context_parallel import check_grouped_kv_under_cp
from ..distributed.sequence_parallel import ulysses_module
from ..loss.heads import LossOptions
from ..offload.checkpointing import checkpointed_layers, install_offload, uninstall_offload
from ..optimizers.spec import BACKWARD
from ..optimizers.in_backward import is_stepped_in_backward, step_in_backward
from ..plan.choose import options_for_length
from ..plan.options import LENGTH_OPTIONS, TilingOptions, forget_options, remember_options
from ..plan.plans import AutoPlacement
from .bundles import bundles
from .describe import log_summary
from .follow import install_follower, uninstall_follower
from .patch import check_model, install, tiled_names, uninstall
from .planning import plan
from .state import TilingState

__all__ = ["enable_tiling", "disable_tiling", "tiled_modules"]

log = logging.getLogger("tiledmlp")


def enable_tiling(model: nn.Module, strategy: str = "auto", num_shards: Optional[int] = None,
                  loss: Optional[bool] = None, *, options: Optional[TilingOptions] = None, **kwargs: Any) -> nn.Module:
    """Tile every recognized MLP block of ``model`` in place (per instance; the root included), and the LM
    head + cross-entropy of every Hugging Face causal LM in it (unless ``loss=False``).

    Args:
        model: a bare model, or one wrapped by DDP / FSDP1 / FSDP2 / DeepSpeed / a TP plan (tiling may also be
            enabled before wrapping with ``strategy="auto"``).
        strategy, num_shards, loss: the first three fields of :class:`TilingOptions`, positional as before.
        options: every option as one :class:`TilingOptions` instead of keywords (not both: a TypeError).
        **kwargs: the other fields of :class:`TilingOptions` (``tiledmlp.plan.options``), each documented there in
            one line; what each costs and saves is ``docs/api.md``, "enable_tiling's options". Checked once, before
            the model is touched.

    Logs one INFO line (what was tiled, strategies, scratch at 128K tokens) and a WARNING for every
    module that looks like an MLP but takes the generic form, with the reason; :func:`describe`
    gives the same per module.

    Returns the same ``model``. Calling it again re-configures (never double-wraps; the loss is tiled
    if the last call asked for it). On error nothing is changed. A model whose SDPA attention has grouped KV
    heads and whose parameters live on a mesh with a ``cp`` dimension is refused (torch's ring attention fails on
    it, tiled or not), naming :func:`repeat_kv_heads`; the tiled loss checks again at each call.

    Memory: each tiled MLP keeps only its input (``tokens * hidden``) for backward, instead of
    several ``tokens * intermediate`` activations; backward adds one shard's intermediates, one
    gradient accumulator per trainable parameter (2 bytes per bf16 weight element by default) and a
    partial-gradient buffer of at most 64 MiB. The tiled loss keeps the head's input gradient and
    gradient accumulator from its forward to its backward, plus its scratch budget while it runs (no
    ``tokens x vocab`` tensor). Communication: none added — each parameter's gradient reaches the
    wrapper once per backward, as untiled.
    """
    check_model(model, "enable_tiling")
    options = _options(options, kwargs, strategy, num_shards, loss)
    check_grouped_kv_under_cp(model)
    options, chosen_because = _options_for(model, options) if options.seq_len is not None else (options, "")
    made = bundles(model, options, chosen_because)
    offload_layers = checkpointed_layers(model, options.offload)
    states = plan(model, made.plan, made.loss, loss_required=options.loss is True)
    layers = _attention_layers(model, states, options.attention)
    _warn_options_without_effect(model, states, options.projections, options.grad_accum_dtype, made.loss)
    uninstall_attention(model)  # before the forwards it wraps are restored or replaced
    install(model, states)
    install_follower(model, made.plan)
    _place_optimizer_object(options.optimizer, options.optimizer_placement)
    remember_options(model, options, made.step)
    install_offload(model, offload_layers, AutoPlacement(model, made.step) if options.offload == "auto" else None)
    # A block's first training call finds DeepSpeed's Ulysses, if it runs the block's attention by then (a Trainer
    # registers it after the model is tiled): its calls there exchange per KV-head slot (tiledmlp.attention.ulysses).
    install_attention(model, layers, made.policy.scratch_mib, find_ulysses=ulysses_module)
    # A tiled norm remembers which output it returned from which input only where q/k/v may take it
    # (tiledmlp.attention): elsewhere nothing would read it.
    for state in states.values():
        if state.kind == Kind.NORM:
            state.remembers_output = bool(layers)
    log_summary(model)
    return model


def _options(options: Optional[TilingOptions], kwargs: dict[str, Any], strategy: str, num_shards: Optional[int],
             loss: Optional[bool]) -> TilingOptions:
    """The options given as one object or as keywords (a ``TypeError`` for both); the rule that belongs to the call:
    ``gpu_mib`` and ``host_mib`` are budgets of ``offload="auto"`` or ``seq_len``'s plan."""
    if options is None:
        options = TilingOptions.from_kwargs(dict(kwargs, strategy=strategy, num_shards=num_shards, loss=loss))
    elif not isinstance(options, TilingOptions):
        raise TypeError(f"enable_tiling's options= takes a tiledmlp.TilingOptions, got {type(options).__name__}; "
                        "pass keyword options as enable_tiling(model, norms=True, ...)")
    elif kwargs or strategy != "auto" or num_shards is not None or loss is not None:
        raise TypeError("enable_tiling takes its options as options=TilingOptions(...) or as keywords (strategy, "
                        "num_shards, loss, norms, ...), not both: put them all in the TilingOptions "
                        "(dataclasses.replace(options, ...) changes some of one)")
    for key in ("gpu_mib", "host_mib"):
        if getattr(options, key) is not None and options.offload != "auto" and options.seq_len is None:
            raise ValueError(f"{key} is a budget of offload='auto' (where each checkpointed layer's input waits); "
                             f"pass offload='auto' with it, or leave it out")
    return options


def _attention_layers(model: nn.Module, states: dict[str, TilingState], attention: bool) -> list[Any]:
    """The layers whose attention block ``attention=True`` runs (a ValueError where the model has none)."""
    layers = attention_scopes(model, states) if attention else []
    if attention and not layers:
        raise ValueError(f"attention=True runs the attention block of each layer of the model's layer stack (the "
                         f"items of its outermost nn.ModuleList) with the attention core's backward in KV-head "
                         f"groups, but {type(model).__name__} has no nn.ModuleList of layers; leave attention=False")
    return layers


def _options_for(model: nn.Module, options: TilingOptions) -> tuple[TilingOptions, str]:
    """``seq_len=T``: the memory options not given filled in from the plan for that length (``tiledmlp.plan``), said
    once, and why, in one phrase. ValueError, naming the longest length that fits, when nothing does."""
    given = {k: v for k, v in options.given().items() if k in LENGTH_OPTIONS}
    chosen, plan, why = options_for_length(model, options.seq_len, given, options.gpu_mib, options.host_mib)
    if chosen.pop("checkpointing", False):  # the length fits only with the layers checkpointed
        enable_checkpointing(model)
        why = f"checkpointing turned on ({checkpointing_call(model)}), which the length needs; {why}"
    because = f"seq_len={options.seq_len}: {', '.join(f'{k}={v!r}' for k, v in chosen.items())} ({why})"
    log.info("enable_tiling: %s; %s%s", because, plan.table().splitlines()[0].split(": ", 1)[1],
             f"; optimizer {plan.optimizer.label()}: {plan.optimizer_choice}" if plan.optimizer_choice else "")
    loss = options.loss if "loss" in given else (None if chosen["loss"] else False)
    return replace(options, **{k: v for k, v in chosen.items() if k != "loss"}, loss=loss), because


def _place_optimizer_object(optimizer: Any, placement: Optional[str]) -> None:
    """An optimizer object the plan steps in backward is made to (the plan and the step must agree), said once."""
    if isinstance(optimizer, torch.optim.Optimizer) and placement == BACKWARD and not is_stepped_in_backward(optimizer):
        step_in_backward(optimizer)
        log.info("enable_tiling: %s now steps each parameter inside backward and frees its gradient "
                 "(tiledmlp.step_in_backward): one micro-batch per step, and no global-norm clipping",
                 type(optimizer).__name__)


def _warn_options_without_effect(model: nn.Module, states: dict[str, TilingState], projections: bool,
                           accum: Optional[torch.dtype], loss_options: Optional[LossOptions]) -> None:
    """Options that would silently do nothing or lose precision on this model, said once each."""
    if projections and not any(s.kind == Kind.PROJ for s in states.values()):
        log.warning("projections=True tiles peft LoRA layers outside the MLPs and heads, but %s has none yet: "
                    "nothing more is tiled now (LoRA layers added later, by get_peft_model or a trainer's "
                    "peft_config, are tiled at the model's next training call)", type(model).__name__)
    for option, dtype, kinds in (("grad_accum_dtype", accum, lambda k: k != Kind.LOSS),
                                 ("loss_grad_accum_dtype", loss_options and loss_options.grad_accum_dtype,
                                  lambda k: k == Kind.LOSS)):
        if dtype is None or dtype.itemsize >= 4:
            continue
        wider = sorted({str(p.dtype) for s in states.values() if kinds(s.kind) for p in s.params() or ()
                        if p.requires_grad and p.dtype.itemsize > dtype.itemsize})
        if wider:
            log.warning("%s=%s sums the shards' gradients of %s parameters in %s: each gradient loses precision "
                        "(a float32 model: about 1e-3 relative with float16, 7e-3 with bfloat16). Use None (the "
                        "default: the parameter's own precision or block-scaled float16 for bf16 weights) or "
                        "torch.float32", option, dtype, " and ".join(wider), dtype)


def disable_tiling(model: nn.Module) -> nn.Module:
    """Restore the original forwards of every tiled module in ``model`` (and the loss functions of
    tiled causal LMs); returns ``model``."""
    check_model(model, "disable_tiling")
    uninstall_attention(model)
    uninstall(model)
    uninstall_follower(model)
    uninstall_offload(model)
    forget_options(model)
    return model


def tiled_modules(model: nn.Module) -> dict[str, str]:
    """``{qualified name (as model.named_modules() gives it): strategy name}`` for tiled modules."""
    check_model(model, "tiled_modules")
    return tiled_names(model)
