"""The functional tiled call, :func:`apply_tiled_mlp`: call-compatible with Liger-Kernel's and DeepSpeed's, exact
under every wrapper the module itself can be in (its strategy read off the module alone).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..core.sharding import ShardPolicy
from ..distributed.deepspeed import check_deepspeed_module
from ..distributed.selection import strategy_of_call
from ..distributed.strategies import DeepSpeedStrategy
from ..distributed.tensor_parallel import has_tp_hooks
from ..recognize.modules import param_slots
from .call_spec import TiledCallSpec

__all__ = ["apply_tiled_mlp"]


def apply_tiled_mlp(fn: Callable[[nn.Module, torch.Tensor], Any], mlp_module: nn.Module, x: torch.Tensor,
                    num_shards: Optional[int] = None, compute_params: Optional[Sequence[torch.Tensor]] = None,
                    ddp_safe: bool = False) -> Any:
    """``fn(mlp_module, x)`` computed in token shards, with exact gradients (Liger/DeepSpeed call).

    Args:
        fn: computes the MLP on one shard, ``fn(mlp_module, x_shard)``; it may call the module.
        mlp_module: the module whose parameters ``fn`` uses; all of its parameters are inputs of the
            tiled autograd node.
        x: ``[..., tokens, hidden]``; ``[B, T, H]`` is sharded over all ``B * T`` tokens.
        num_shards: ``None`` for ``ceil(tokens / hidden)``.
        compute_params: accepted for compatibility (DeepSpeed's ``TiledMLP``); each must belong to
            ``mlp_module``. Gradients are computed for every trainable parameter of the module, and
            under ZeRO-3 every partitioned parameter of the module is gathered once per call in forward
            and once in backward (strategy ``deepspeed``), whatever ``compute_params`` lists.
        ddp_safe: accepted for compatibility. The path is always DDP-safe: shard gradients are summed
            inside one autograd node, so each parameter's hook fires once per backward and existing
            ``.grad`` values (micro-batch accumulation) are never zeroed.

    Memory and communication as for :func:`enable_tiling`.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(mlp_module, x_shard), got {type(fn).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError("x must be a tensor of shape [..., tokens, hidden] with at least 2 dims")
    policy = ShardPolicy(num_shards=num_shards)
    slots = param_slots(mlp_module)
    if not slots and any(isinstance(v, torch.Tensor) and v.requires_grad
                         for m in mlp_module.modules() for v in vars(m).values()):
        # FSDP1 with flat parameters turns the weights into plain-tensor views of the flat parameter
        # during forward: they are not parameters of the module, so they could not be inputs of the
        # tiled node and would silently get no gradient.
        raise ValueError(
            f"{type(mlp_module).__name__} computes with tensors that are not registered parameters "
            "(FSDP1 with use_orig_params=False makes its weights views of a flat parameter), so "
            "apply_tiled_mlp cannot give them gradients. Use use_orig_params=True, or "
            "tiledmlp.enable_tiling(model), which finds them through the flat parameter."
        )
    if compute_params is not None:
        known = {id(s.get()) for s in slots}
        foreign = [tuple(p.shape) for p in compute_params if id(p) not in known]
        if foreign:
            raise ValueError(
                f"compute_params has tensors of shapes {foreign} that are not parameters of mlp_module; "
                "pass the module whose parameters fn uses."
            )
    if any(has_tp_hooks(m) for m in mlp_module.modules()):
        # fn computes through the sharded projections: their collectives would run once per shard.
        raise ValueError(
            f"{type(mlp_module).__name__} is tensor parallel (parallelize_module); apply_tiled_mlp would run "
            "its collectives once per shard. Use tiledmlp.enable_tiling(model), whose 'tp' strategy tiles "
            "the local shards between the untiled module's collectives.")
    strategy = strategy_of_call(list(mlp_module.parameters()), mlp_module)
    if isinstance(strategy, DeepSpeedStrategy):
        check_deepspeed_module(type(mlp_module).__name__, mlp_module)
    if x.numel() == 0:
        return fn(mlp_module, x)
    spec = TiledCallSpec(name=type(mlp_module).__name__, slots=tuple(slots), policy=policy)
    return spec(strategy.prepare_call, mlp_module, lambda xs: fn(mlp_module, xs), x)
