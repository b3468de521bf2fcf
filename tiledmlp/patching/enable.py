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
        model: a bare model, or one wrapped by DDP / FSDP1 / FSDP2 (tiling may also be enabled
            before wrapping with ``strategy="auto"``).
        strategy: ``"auto"`` (detect the wrapper, also at run time), or force one of ``"plain"``,
            ``"ddp"``, ``"no_sync"``, ``"fsdp2"``, ``"fsdp1"``, ``"deepspeed"`` (ZeRO 1-3; also detected
            when tiling is enabled before ``deepspeed.initialize``, from the parameters), ``"tp"``; a forced
            strategy must match the wrapping.
        loss: tile the loss (``tiledmlp.loss.heads``): while the model is called with ``labels``, its
            head returns a placeholder that materializes on demand, and its ``loss_function`` computes
            the same loss with :func:`tiled_linear_cross_entropy`, so the ``tokens x vocab`` logits
            never exist at once. Without labels the head returns real logits, as before. ``None``
            (default): wherever a causal LM's head can be tiled (a head that cannot — wrapped by an adapter,
            a custom loss function, vocabulary-parallel — is logged and left as it is); ``True``: every
            causal LM's, a ValueError where one cannot be; ``False``: the MLPs only. At long context the
            logits, not the MLPs, are most of a model's activation memory (docs/results.md).
        num_shards: shards per call; ``None`` is the automatic policy (see ``tiledmlp.core.sharding``):
            for the fast forms the fewest shards (up to 16384 tokens each, in one or two blocks of
            the intermediate dimension) whose backward scratch fits ``scratch_mib``; for the generic
            form ``ceil(tokens / hidden)`` shards.
        tile_tokens: tokens per shard instead of a shard count (fixed scratch memory).
        inter_chunks: blocks of the intermediate dimension per shard in the fast forms' backward
            (scratch shrinks by that factor); None: automatic.
        scratch_mib: backward scratch budget of the fast forms in MiB (default 512: 16384-token
            shards in two blocks of a Llama-3-8B MLP): the speed/memory knob of the automatic policy.
        form: ``"auto"`` (the fast GLU or plain-MLP form where the probe identifies one, see
            ``tiledmlp.recognize``) or ``"generic"`` (always the module's own forward).
        grad_accum_dtype: how shard gradients are summed (``tiledmlp.core.accumulate``). ``None``: bf16
            weights in block-scaled float16 (2 bytes per element, the gradient's own memory), other
            16-bit parameters in float32; ``torch.float32``: every sum in float32 (exact, 4 bytes);
            ``torch.bfloat16``: the anchors' bf16 running sum.
        mlp_types: extra module types to tile with the generic form (see :func:`register_mlp`).
        include_moe: tile MoE blocks (default True).
        loss_scratch_mib: the tiled loss's scratch budget in MiB: the largest logits chunk, with the
            rest of a shard's scratch (default: the larger of 256 MiB and the hidden states' size).
        loss_mode: ``"auto"``, ``"fused"`` (gradients finished in forward: no logits recompute) or
            ``"recompute"`` (vocabulary chunks, logits recomputed in backward); see ``tiledmlp.loss``.
        loss_grad_accum_dtype: how the head gradient's shard partials are summed: ``torch.float32``
            (default, exact) or ``None`` (block-scaled float16 in 2 bytes per element; less exact with
            many shards). See ``tiledmlp.loss``.
        offload: ``"cpu"``: keep the inputs of the model's checkpointed layers in pinned host memory from
            their forward to their recompute, copied on a side stream and prefetched one layer ahead
            (``tiledmlp.offload``; bit-identical results). ``"auto"``: each layer's input where the memory plan
            (:func:`plan_memory`) puts it for the step's length: kept on the device while the device budget
            allows, on the host while the host budget lasts, else recomputed in backward from the layer below
            (one more layer forward; bit-identical); what the device budget has left is spent on speed: with
            ``attention=True`` each layer's attention output and log-sum-exp kept from its forward for its
            recompute (no second attention forward; 8.1 KiB per token per layer for Llama-3.1-8B; bit-identical),
            then more inputs kept on the device. A length that fits nowhere is a ``MemoryError`` at the step's
            first layer naming the longest that fits. Needs Hugging Face non-reentrant checkpointing
            (``model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})``,
            ``gradient_checkpointing_enable`` before transformers 5.23, before this call); custom models call
            :func:`checkpoint` instead. Default None.
        gpu_mib, host_mib: ``offload="auto"``'s budgets for one step on this rank (default: what the process may
            use when the step starts, minus margins: free device memory and what its allocator holds; available host
            memory, control-group aware).
        seq_len: the tokens per step (per sequence; batch size 1) to plan for: of the memory options not given
            (``norms``, ``attention``), those with which the plan fits and the step is fastest by its estimate
            (``tiledmlp.plan.choose``), ``offload="auto"`` where not given (it spends the rest of the device on
            speed), the layers checkpointed where the length needs it; said in one INFO line with the runner-up; a
            length that fits nowhere is a ValueError naming the longest that does.
        optimizer: the optimizer the training step will run, counted by the plan (``seq_len``, ``offload="auto"``,
            :func:`describe`): an optimizer object, or a name (``"adamw"``: torch's fused AdamW, ``"adamw-foreach"``,
            ``"adamw8bit"``, or the Trainer's ``optim`` names). Default None: none counted (the plan says so).
        optimizer_placement: where the optimizer's memory lives: ``"gpu"``, ``"backward"`` (stepped in backward,
            each gradient freed once used), ``"host"`` (torchao's CPU offload); None: where it is (a name: ``"gpu"``),
            or with ``seq_len`` the fastest that fits. :func:`make_optimizer` builds a named one there; an optimizer
            object placed ``"backward"`` is made to step in backward (:func:`step_in_backward`), said in the log.
        norms: also tile the normalization layers (RMSNorm, LayerNorm, whatever their class: recognized by
            what they compute, ``tiledmlp.recognize.norms``) with the generic form: each keeps only its input for
            backward and computes its float32 intermediates one shard at a time (shards sized by
            ``scratch_mib``), instead of keeping a float32 copy of its input and making several more in
            backward. At long context with checkpointing this is most of a decoder layer's recompute
            peak (16-layer Llama-3.2-1B shape at 128K tokens on an H200: 14.95 -> 10.72 GiB with
            ``offload="cpu"``). Costs one more forward of each norm per shard in backward. Default False.
        projections: also tile every peft LoRA layer on an ``nn.Linear``, ``Conv1D`` or bitsandbytes 4-bit base
            outside the tiled MLPs and heads (attention's q, k, v, o: ``tiledmlp.recognize.projections``): each keeps
            only its input for backward, its adapter's per-token copies (peft's float32 casts of the input, the low-rank
            outputs) exist one shard at a time, and its fast form never recomputes the base projection (no more
            FLOPs than untiled; an adapter with dropout takes the generic form, said). With LoRA at long context
            they are most of a checkpointed layer's recompute peak (Llama-3.1-8B QLoRA under bf16 autocast on an
            H100: 124.8 -> 104.8 KiB per token, the longest sequence 581,632 -> 692,224 tokens;
            ``docs/integrations.md``). Default False.
        attention: less memory per token around the attention core (``tiledmlp.attention``): every
            ``F.scaled_dot_product_attention`` call made in a layer's attention block that needs a gradient and has
            no mask or dropout runs SDPA's own kernel (cuDNN or flash) with its backward one group of KV heads at a
            time (``tiledmlp.attention.grouped``), so the float32 dq accumulator and the grouped-KV expanded dk/dv
            exist for one group, not for all heads (Llama-3.1-8B: 44.1 -> 17.5 KiB per token); with ``norms=True``,
            q, k and v keep the tiled input norm's input instead of its output and compute the output again in
            backward. The same values and gradients, no more FLOPs: a Llama-3.1-8B step 96.7 -> 60.6 KiB per token,
            no slower (``docs/long-context.md``). Calls it cannot take run as before, with the reason logged once
            and in :func:`describe`. Default False.
        options: all of the above as one :class:`TilingOptions` instead of keywords (not both: a TypeError);
            the keywords make one, checked once (``tiledmlp.plan.options``).

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
    _say_what_does_nothing(model, states, options.projections, options.grad_accum_dtype, made.loss)
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


def _say_what_does_nothing(model: nn.Module, states: dict[str, TilingState], projections: bool,
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
