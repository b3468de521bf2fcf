"""Grouped KV heads under torch's context parallelism: the heads repeated before the ring.

[Note: why the heads are repeated at the projections]
torch's ``context_parallel`` swaps ``F.scaled_dot_product_attention`` for a ring over the ``cp`` ranks, and its
ring has no grouped-query path: given ``enable_gqa=True`` (which transformers' SDPA call passes when there is no
mask — always under context parallelism, whose hooks drop the mask for ``is_causal``) it fails with ``aten.add.Tensor
got mixed torch.Tensor and DTensor``, tiled or not. Every Llama-3, Qwen and Mistral model has grouped KV heads.
The Trainer accepts context parallelism only for the ``"sdpa"`` implementation, so another attention function is
no fix; transformers' own SDPA call repeats the KV heads whenever the module says it has one KV head per query head
(``num_key_value_groups == 1``). :func:`repeat_kv_heads` therefore repeats each KV head's columns in the outputs
of ``k_proj`` and ``v_proj`` (a forward hook: the head layout ``repeat_kv`` gives, head ``h`` reading KV head
``h // groups``) and sets ``num_key_value_groups`` to 1. Rotary embeddings and per-head norms act on each head
alone, so the repeated heads are computed exactly as ``repeat_kv`` would copy them, and autograd sums the copies'
gradients into the projection's. Cost: the K and V activations ``groups`` times larger, as the eager path's
``repeat_kv`` makes them (the attention core's, not the MLP's). A norm over the whole projection (OLMo-2's
``k_norm``) or a fused QKV projection cannot be repeated this way: refused, naming the modules.

:func:`ring_ready` does all a transformers model needs before torch's ring, as accelerate's context parallelism does
it: the KV heads repeated, and each attention module called causal without a mask (the ring takes none, and
transformers would build one from the cut, non-contiguous positions); a model whose layers mask more than causally
(sliding-window, chunked attention) is refused, since dropping their mask would train them with full causal
attention.

:func:`check_grouped_kv_under_cp` is what ``enable_tiling`` and the tiled loss's call run: a model with grouped
KV heads in SDPA attention whose parameters live on a mesh with a ``cp`` dimension is refused, naming
:func:`repeat_kv_heads`, before anything is computed or patched.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from .sequence_parallel import SequenceSplit, split_of

__all__ = ["RepeatedKVHeads", "repeat_kv_heads", "check_grouped_kv_under_cp", "RingReady", "ring_ready"]

logger = logging.getLogger("tiledmlp")


def _grouped_attentions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every attention module that shares a KV head between query heads."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "num_key_value_groups", None), int) and m.num_key_value_groups > 1]


def _uses_sdpa(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == "sdpa"


def check_grouped_kv_under_cp(model: nn.Module, split: Optional[SequenceSplit] = None) -> None:
    """Refuse grouped KV heads in SDPA attention under torch's context parallelism ([Note: why the heads are repeated at
    the projections]), naming the fix.
    ``split``: the model's, where the caller knows it (default: :func:`split_of`). Costs one scan of the model's
    modules when its sequence is split by context parallelism, nothing otherwise."""
    split = split if split is not None else split_of(model)
    if split is None or split.kind != "cp":
        return
    grouped = [name for name, _ in _grouped_attentions(model)]
    if grouped and any(_uses_sdpa(m) for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__}: its sequence is split by torch context parallelism ({split.size} ranks) and "
            f"its SDPA attention shares KV heads between query heads ({grouped[0]}"
            f"{f' and {len(grouped) - 1} more' if len(grouped) > 1 else ''}): torch's ring attention has no "
            "grouped-query path and fails on it ('aten.add.Tensor got mixed torch.Tensor and DTensor'), tiled or "
            "not. Call tiledmlp.repeat_kv_heads(model) first (the KV heads repeated at k_proj/v_proj, exact).")


class _RepeatHeads:
    """Forward hook on ``k_proj``/``v_proj``: each head's ``head_dim`` columns repeated ``groups`` times in place
    (``[..., kv * d] -> [..., kv * groups * d]``, the layout of transformers' ``repeat_kv``)."""

    def __init__(self, head_dim: int, groups: int) -> None:
        self.head_dim = head_dim
        self.groups = groups

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        *lead, width = output.shape
        heads = width // self.head_dim
        per_head = output.reshape(*lead, heads, 1, self.head_dim)
        return per_head.expand(*lead, heads, self.groups, self.head_dim).reshape(*lead, heads * self.groups * self.head_dim)


class RepeatedKVHeads:
    """What :func:`repeat_kv_heads` changed; :meth:`remove` restores it."""

    def __init__(self) -> None:
        self._undo: list[tuple[nn.Module, int, list[Any]]] = []

    @property
    def modules(self) -> list[nn.Module]:
        """The attention modules whose KV heads are repeated."""
        return [module for module, _, _ in self._undo]

    def remove(self) -> None:
        """Remove the hooks and give each attention module its ``num_key_value_groups`` back."""
        for module, groups, handles in self._undo:
            for handle in handles:
                handle.remove()
            module.num_key_value_groups = groups
        self._undo.clear()


def _why_not_repeatable(module: nn.Module) -> str:
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int):
        return "no integer head_dim"
    for name in ("k_proj", "v_proj"):
        if not isinstance(getattr(module, name, None), nn.Module):
            return f"no {name} (a fused projection?)"
    norm = getattr(module, "k_norm", None)
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.numel() != head_dim:
        return f"k_norm normalizes the whole projection ({weight.numel()} features), not each head"
    return ""


def repeat_kv_heads(model: nn.Module) -> RepeatedKVHeads:
    """Repeat every grouped KV head of ``model``'s attention at its ``k_proj``/``v_proj`` outputs and set
    ``num_key_value_groups`` to 1, so that transformers' SDPA call never asks for grouped-query attention: what
    torch's ``context_parallel`` needs for Llama-3/Qwen/Mistral models ([Note: why the heads are repeated at the
    projections]). Exact (values and gradients equal the grouped model's); call it before training under context
    parallelism, with or without tiling.

    Memory: each layer's K and V activations ``num_key_value_groups`` times larger, as the eager path makes them; a
    KV cache filled meanwhile holds the repeated heads. Communication: the ring exchanges the repeated K and V (its
    own cost for an ungrouped model). Returns a handle whose ``remove()`` restores the model. A module that cannot be
    repeated this way (a fused QKV projection, a norm over the whole projection) raises ``ValueError`` naming it,
    model untouched; a model without grouped heads is left as it is.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"repeat_kv_heads takes an nn.Module, got {type(model).__name__}")
    grouped = _grouped_attentions(model)
    refused = [(name, why) for name, m in grouped if (why := _why_not_repeatable(m))]
    if refused:
        listed = "; ".join(f"{name}: {why}" for name, why in refused[:3])
        raise ValueError(f"repeat_kv_heads cannot repeat the KV heads of {len(refused)} attention module(s) ({listed}); "
                         "model untouched. Such a model needs an attention implementation with a grouped-query path "
                         "under context parallelism, or no context parallelism.")
    handle = RepeatedKVHeads()
    for _, module in grouped:
        hook = _RepeatHeads(module.head_dim, module.num_key_value_groups)
        handles = [module.k_proj.register_forward_hook(hook), module.v_proj.register_forward_hook(hook)]
        handle._undo.append((module, module.num_key_value_groups, handles))
        module.num_key_value_groups = 1
    if not grouped:
        logger.info("tiledmlp.repeat_kv_heads: %s has no grouped KV heads; nothing changed", type(model).__name__)
    return handle


def _causal_without_mask(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook on an attention module: no mask, ``is_causal=True``."""
    return args, {**kwargs, "attention_mask": None, "is_causal": True}


def _stricter_than_causal(model: nn.Module) -> list[str]:
    """The layer types of ``model`` whose mask is stricter than causal (transformers' ``layer_types``; a
    ``sliding_window`` without them: every layer)."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return sorted({t for t in layer_types if t != "full_attention"})
    return ["sliding_attention"] if getattr(config, "sliding_window", None) else []


class RingReady:
    """What :func:`ring_ready` changed; :meth:`remove` restores it."""

    def __init__(self, repeated: Optional[RepeatedKVHeads], hooks: list[Any]) -> None:
        self.repeated = repeated
        self.hooks = hooks

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        if self.repeated is not None:
            self.repeated.remove()


def ring_ready(model: nn.Module) -> RingReady:
    """Prepare a transformers model for torch's ring attention (``context_parallel``): grouped KV heads repeated
    (:func:`repeat_kv_heads`) and every attention module (a module named ``*self_attn``) called with
    ``is_causal=True`` and no mask, as accelerate does under context parallelism. Exact for causal language models
    without padding (the ring's only mask is causal). A model whose layers use a stricter mask (sliding-window or
    chunked attention) raises ``ValueError``, model untouched. Memory and communication: those of
    :func:`repeat_kv_heads`. Returns a handle whose ``remove()`` restores the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"ring_ready takes an nn.Module, got {type(model).__name__}")
    stricter = _stricter_than_causal(model)
    if stricter:
        raise ValueError(f"{type(model).__name__} has attention layers of type {stricter}: torch's ring attention "
                         "takes no mask, so they would train with full causal attention; model untouched. Use a "
                         "full-attention model, or no context parallelism.")
    attentions = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    if not attentions:
        raise ValueError(f"ring_ready found no attention module (named *self_attn) in {type(model).__name__}; "
                         "model untouched")
    repeated = repeat_kv_heads(model) if _grouped_attentions(model) else None
    hooks = [m.register_forward_pre_hook(_causal_without_mask, with_kwargs=True, prepend=True) for m in attentions]
    return RingReady(repeated, hooks)
