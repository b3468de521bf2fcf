"""What the memory model reads from a model, never running it: the decoder's shapes (its Hugging Face config) and the
bytes this rank holds of each parameter (its shard under FSDP, ZeRO-3 or tensor parallelism)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..distributed.deepspeed import is_zero3_param
from ..offload.checkpointing import checkpointing_modules

__all__ = ["ModelShape", "model_shape", "local_bytes"]


def local_bytes(p: torch.Tensor) -> int:
    """Bytes of ``p`` on this rank: a ZeRO-3 parameter's partition, a DTensor's local shard, else the tensor."""
    if is_zero3_param(p):
        return p.ds_tensor.numel() * p.ds_tensor.element_size()
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel() * local.element_size()


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only model as the memory model sees it (bytes are this rank's)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int  # decoder layers of the config
    checkpointed: int  # of them, the modules that checkpoint their calls (0: no activation checkpointing)
    act_itemsize: int  # bytes per activation element (the parameters' floating dtype)
    weight_bytes: int
    grad_bytes: int  # every trainable parameter's gradient
    embedding_grad_bytes: int  # the input embedding's, allocated after every layer's backward
    trainable_bytes: int
    layer_grad_bytes: tuple[int, ...]  # each checkpointed layer's trainable bytes, in forward order

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_input_bytes_per_token(self) -> int:
        """What a checkpointed layer keeps per token from its forward to its backward: its input."""
        return self.hidden * self.act_itemsize


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        inner = getattr(model, "module", None)  # DDP, a DeepSpeed engine
        config = getattr(inner, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return config


def _call(model: nn.Module, method: str) -> Optional[nn.Module]:
    for m in (model, getattr(model, "module", None)):
        if m is not None and hasattr(m, method):
            return getattr(m, method)()
    return None


def model_shape(model: nn.Module, act_dtype: Optional[torch.dtype] = None) -> ModelShape:
    """The shapes and per-rank bytes of ``model`` (a Hugging Face causal LM, bare or wrapped). ``act_dtype``: the
    activations' dtype (under autocast), default the parameters' floating dtype. ValueError, naming what is
    missing, for a model without a decoder config."""
    config = _text_config(model)
    needed = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
    missing = [k for k in needed if getattr(config, k, None) is None] if config is not None else list(needed)
    if missing:
        raise ValueError(f"plan_memory reads a decoder's shapes from its Hugging Face config, but "
                         f"{type(model).__name__} has no {', '.join(missing)} (model.config); it plans Hugging Face causal LMs (bare or "
                         "wrapped) only")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    params = list(dict.fromkeys(model.parameters()))
    floating = [p for p in params if p.is_floating_point()]
    common = Counter(p.dtype for p in floating).most_common(1)
    itemsize = act_dtype.itemsize if act_dtype is not None else common[0][0].itemsize if common else 4
    embedding = getattr(_call(model, "get_input_embeddings"), "weight", None)
    if embedding is not None and getattr(_call(model, "get_output_embeddings"), "weight", None) is embedding:
        embedding = None  # tied: its gradient comes with the head's, first in backward
    trainable = [p for p in params if p.requires_grad]
    layers = checkpointing_modules(model)
    return ModelShape(
        hidden=config.hidden_size, heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim, vocab=config.vocab_size, layers=config.num_hidden_layers,
        checkpointed=len(layers), act_itemsize=itemsize,
        weight_bytes=sum(local_bytes(p) for p in params),
        grad_bytes=sum(local_bytes(p) for p in trainable),
        embedding_grad_bytes=local_bytes(embedding) if embedding is not None and embedding.requires_grad else 0,
        trainable_bytes=sum(local_bytes(p) for p in trainable),
        layer_grad_bytes=tuple(sum(local_bytes(p) for p in m.parameters() if p.requires_grad) for m in layers))
