"""What the memory model reads from a model, never running it: the decoder's shapes (its Hugging Face config) and the
bytes this rank holds of each parameter (its shard under FSDP, ZeRO-3 or tensor parallelism) and where: on its device,
or on the host (FSDP2's ``CPUOffloadPolicy``), which also says which device the model computes on."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..distributed.deepspeed import is_zero3_param
from ..offload.checkpointing import checkpointing_modules

__all__ = ["ModelShape", "model_shape", "local_bytes", "device_bytes", "kept_on_host", "compute_device",
           "decoder_layers"]


def local_bytes(p: torch.Tensor) -> int:
    """Bytes of ``p`` on this rank: a ZeRO-3 parameter's partition, a DTensor's local shard, else the tensor."""
    if is_zero3_param(p):
        return p.ds_tensor.numel() * p.ds_tensor.element_size()
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel() * local.element_size()


def kept_on_host(p: torch.Tensor) -> bool:
    """Whether ``p`` is a shard FSDP2's ``CPUOffloadPolicy`` keeps on the host: a ``DTensor`` whose local shard is on
    the CPU while its mesh computes on an accelerator. Its gradient lands there too; only its gathered copy, during
    its unit's forward and backward, is on the device."""
    mesh = getattr(p, "device_mesh", None)
    return (mesh is not None and hasattr(p, "to_local") and mesh.device_type != "cpu"
            and p.to_local().device.type == "cpu")


def device_bytes(p: torch.Tensor) -> int:
    """Bytes of ``p`` (and of its gradient) this rank holds on its device between uses: its :func:`local_bytes`, or 0
    for a shard kept on the host (:func:`kept_on_host`)."""
    return 0 if kept_on_host(p) else local_bytes(p)


def compute_device(model: nn.Module) -> torch.device:
    """The device ``model`` computes on: its parameters', or, for FSDP2 shards kept on the host, their mesh's
    accelerator (the current one of its type)."""
    first = next(model.parameters(), None)
    if first is None or not kept_on_host(first):
        return first.device if first is not None else torch.device("cpu")
    kind = first.device_mesh.device_type
    module = torch.get_device_module(kind)
    return torch.device(kind, module.current_device()) if module.is_available() else torch.device(kind)


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only model as the memory model sees it (bytes are this rank's: the weights' and gradients' those on
    its device, :func:`device_bytes`)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int  # decoder layers of the config
    checkpointed: int  # of them, the modules that checkpoint their calls (0: no activation checkpointing: then
    # ``layer_grad_bytes`` and its like are the decoder's layers', each keeping its whole forward's activations)
    act_itemsize: int  # bytes per activation element (the parameters' floating dtype)
    weight_bytes: int
    grad_bytes: int  # every trainable parameter's gradient
    embedding_grad_bytes: int  # the input embedding's, allocated after every layer's backward
    trainable_bytes: int
    layer_grad_bytes: tuple[int, ...]  # each checkpointed layer's trainable bytes, in forward order
    gathered_bytes: int = 0  # FSDP2: the whole parameters its units hold gathered at a layer's backward
    # each checkpointed layer's largest child's trainable bytes (its MLP's): the gradients a layer's backward holds at
    # once where each is stepped (or copied to the host) and freed as it completes
    layer_unit_grad_bytes: tuple[int, ...] = ()
    tied_grad_bytes: int = 0  # a head tied to the input embedding: its gradient waits for the embedding's share
    intermediate: int = 0  # the MLP's intermediate size (0: not in the config)

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


def decoder_layers(model: nn.Module, layers: int) -> list[nn.Module]:
    """The decoder's layers, in forward order: the modules that checkpoint their calls, else the first
    ``nn.ModuleList`` of ``layers`` items (a model without checkpointing)."""
    checkpointing = checkpointing_modules(model)
    if checkpointing:
        return checkpointing
    return next((list(m) for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == layers), [])


def model_shape(model: nn.Module, act_dtype: Optional[torch.dtype] = None,
                checkpointed: Optional[bool] = None) -> ModelShape:
    """The shapes and per-rank bytes of ``model`` (a Hugging Face causal LM, bare or wrapped). ``act_dtype``: the
    activations' dtype (under autocast), default the parameters' floating dtype. ``checkpointed``: as if its layers
    checkpointed (True) or not (False) their calls; None: as they do. ValueError, naming what is missing, for a model
    without a decoder config."""
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
    tied = embedding is not None and getattr(_call(model, "get_output_embeddings"), "weight", None) is embedding
    tied_grad = device_bytes(embedding) if tied and embedding.requires_grad else 0
    if tied:
        embedding = None  # its gradient comes with the head's, first in backward
    trainable = [p for p in params if p.requires_grad]
    layers = decoder_layers(model, config.num_hidden_layers)
    if checkpointed is None:
        checkpointed = bool(checkpointing_modules(model))
    in_layers = {id(p) for m in layers for p in m.parameters()}
    return ModelShape(
        hidden=config.hidden_size, heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim, vocab=config.vocab_size, layers=config.num_hidden_layers,
        checkpointed=len(layers) if checkpointed else 0, act_itemsize=itemsize,
        weight_bytes=sum(device_bytes(p) for p in params),
        grad_bytes=sum(device_bytes(p) for p in trainable),
        embedding_grad_bytes=device_bytes(embedding) if embedding is not None and embedding.requires_grad else 0,
        trainable_bytes=sum(local_bytes(p) for p in trainable),
        layer_grad_bytes=tuple(sum(device_bytes(p) for p in m.parameters() if p.requires_grad) for m in layers),
        layer_unit_grad_bytes=tuple(max((sum(device_bytes(p) for p in c.parameters() if p.requires_grad)
                                         for c in m.children()), default=0) for m in layers),
        tied_grad_bytes=tied_grad, intermediate=getattr(config, "intermediate_size", None) or 0,
        gathered_bytes=_gathered_bytes([p for p in params if id(p) not in in_layers],
                                       [list(m.parameters()) for m in layers], embedding))


def _gathered_bytes(outside: list[torch.Tensor], layers: list[list[torch.Tensor]],
                    embedding: Optional[torch.Tensor]) -> int:
    """What FSDP2 (parameters that are ``DTensor`` shards) holds whole at a layer's backward beyond the shards: the
    root unit's parameters (the embeddings, the final norm, the head: not resharded between forward and backward),
    the layer's own (twice where another layer is there to prefetch), and the root's gradients but the input
    embedding's (reduce-scattered only once the embedding's, last in backward, is made) less the shards the device
    holds anyway (none under ``CPUOffloadPolicy``: the whole gradients wait on the device, and only their shards go
    to the host); 0 for parameters that are not FSDP2's. Each term is seen at a profiled peak
    (``benchmarks/results/profile_layer_memory_sp_*``; under ``CPUOffloadPolicy`` the head's whole gradient in
    ``..._fsdp2_offload_policy.md``)."""
    def whole(tensors: list[torch.Tensor]) -> int:
        return sum(p.numel() * p.element_size() for p in tensors if hasattr(p, "to_local"))

    layer = max((whole(ps) for ps in layers), default=0)
    root_grads = [p for p in outside if p.requires_grad and p is not embedding]
    unsharded_grads = whole(root_grads) - sum(device_bytes(p) for p in root_grads if hasattr(p, "to_local"))
    return whole(outside) + layer * min(len(layers), 2) + unsharded_grads
