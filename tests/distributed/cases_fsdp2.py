"""FSDP2 (``fully_shard``) cases, run by ``worker.py``: the unit is the decoder layer, the MLP itself,
or only the root; ``reshard_after_forward`` True / False (int: ``cases_fsdp2_world4.py``); gradient
accumulation; tiling before and after wrapping; bf16 mixed precision.

Collectives are counted by wrapping ``torch.distributed``'s functions (FSDP2 calls
``all_gather_single`` / ``reduce_scatter_single`` in torch 2.13, ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` in older releases; all are wrapped).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common import (
    ApplyInForwardMLP, Block, Env, ForwardApplyBlock, GLUMLP, Recipe, TinyLM, enable, fsdp2_sync,
    mixed_precision_metrics, registry, token_batches, untiled_vs_tiled, use_apply,
)

CASES, case = registry()


def fsdp2(env: Env, unit: Optional[type], replicas: int = 1, **options: Any) -> Callable[[nn.Module], nn.Module]:
    """``fully_shard`` every module of type ``unit`` (None: none), then the root: on a 1-D mesh, or with ``replicas``
    > 1 on a ``(replicate, shard)`` mesh (HSDP: each parameter sharded within a group of ``world / replicas`` ranks,
    as inside a node, and replicated across the groups, as across nodes)."""
    mesh = (init_device_mesh(env.device.type, (env.world,)) if replicas == 1 else
            init_device_mesh(env.device.type, (replicas, env.world // replicas), mesh_dim_names=("replicate", "shard")))

    def wrap(model: nn.Module) -> nn.Module:
        if unit is not None:
            for m in [m for m in model.modules() if isinstance(m, unit)]:
                fully_shard(m, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        return model

    return wrap


def fsdp2_lm(env: Env, unit: Optional[type], micro: int = 1, optimizer: str = "sgd", **options: Any) -> Recipe:
    """TinyLM under FSDP2 with ``unit`` modules (and the root) sharded with ``options``."""
    return Recipe(build=TinyLM, batches=token_batches(env, micro=micro), wrap=fsdp2(env, unit, **options),
                  optimizer=optimizer)


@case
def fsdp2_compiled_layer_units(env: Env) -> dict[str, Any]:
    """torchtitan's order: tiling, torch.compile per block, then fully_shard per block and the root."""
    from cases_ddp import compile_blocks, with_graph_counts

    recipe = fsdp2_lm(env, Block)
    shard = recipe.wrap
    counters: list = []
    recipe.wrap, recipe.tile_before_wrap = (lambda model: shard(compile_blocks(model, counters))), True
    return with_graph_counts(untiled_vs_tiled(recipe, env), counters)


@case
def fsdp2_layer_units(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(fsdp2_lm(env, Block, optimizer="adamw"), env)


@case
def fsdp2_cpu_offload_policy(env: Env) -> dict[str, Any]:
    """FSDP2's ``CPUOffloadPolicy``: the sharded parameters, their gradients and the optimizer's step on the host
    (the optimizer placement ``"host"`` of an FSDP2 model); AdamW, so the states follow the gradients exactly."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    policy = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
    return untiled_vs_tiled(fsdp2_lm(env, Block, optimizer="adamw", offload_policy=policy), env)


@case
def fsdp2_mlp_units(env: Env) -> dict[str, Any]:
    """The tiled MLP is an FSDP unit itself: its hooks run around the tiled forward, never inside backward."""
    return untiled_vs_tiled(fsdp2_lm(env, GLUMLP), env)


@case
def fsdp2_root_only(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(fsdp2_lm(env, None), env)


@case
def fsdp2_layer_units_keep_unsharded(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(fsdp2_lm(env, Block, reshard_after_forward=False), env)


@case
def fsdp2_mlp_units_keep_unsharded(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(fsdp2_lm(env, GLUMLP, reshard_after_forward=False), env)


@case
def fsdp2_tile_before_wrap_layer_units(env: Env) -> dict[str, Any]:
    recipe = fsdp2_lm(env, Block)
    recipe.tile_before_wrap = True
    return untiled_vs_tiled(recipe, env)


@case
def fsdp2_tile_before_wrap_mlp_units(env: Env) -> dict[str, Any]:
    recipe = fsdp2_lm(env, GLUMLP)
    recipe.tile_before_wrap = True
    return untiled_vs_tiled(recipe, env)


@case
def fsdp2_generic_form(env: Env) -> dict[str, Any]:
    recipe = fsdp2_lm(env, GLUMLP)
    recipe.tile = enable(tile_tokens=16, form="generic")
    return untiled_vs_tiled(recipe, env)


@case
def fsdp2_no_sync_accumulation(env: Env) -> dict[str, Any]:
    """3 micro-batches per step, the first 2 after set_requires_gradient_sync(False); forced 'no_sync'."""
    recipe = fsdp2_lm(env, Block, micro=3)
    recipe.sync = fsdp2_sync
    recipe.tile = enable(strategy="no_sync", tile_tokens=16)
    return untiled_vs_tiled(recipe, env)


@case
def fsdp2_no_sync_mlp_units(env: Env) -> dict[str, Any]:
    recipe = fsdp2_lm(env, GLUMLP, micro=2)
    recipe.sync = fsdp2_sync
    return untiled_vs_tiled(recipe, env)


class InPlaceAfterMLPBlock(Block):
    """Scales the MLP's output in place. The tiled output is a view (FSDP2 warns about it); an in-place
    op on an FSDP2 unit's view output drops FSDP2's pre-backward hook, so nobody re-gathers the unit's
    parameters before the tiled node's backward: the strategy's own unshard has to."""

    def call_mlp(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(x)
        out *= 1.5
        return out


@case
def fsdp2_in_place_on_mlp_unit_output(env: Env) -> dict[str, Any]:
    recipe = fsdp2_lm(env, GLUMLP)
    recipe.build = lambda: TinyLM(block=InPlaceAfterMLPBlock)
    return untiled_vs_tiled(recipe, env)


@case
def fsdp2_apply_tiled_mlp_outside_unit(env: Env) -> dict[str, Any]:
    """The block calls ``apply_tiled_mlp`` on its fully_shard-ed MLP without calling the unit: the
    strategy gathers the unit's parameters itself, for forward and again for backward."""
    recipe = fsdp2_lm(env, GLUMLP)
    recipe.build = lambda: TinyLM(block=ForwardApplyBlock)
    recipe.tile = use_apply
    return untiled_vs_tiled(recipe, env)


@case
def fsdp2_apply_tiled_mlp_in_unit_forward(env: Env) -> dict[str, Any]:
    """Liger's pattern — the MLP's forward calls ``apply_tiled_mlp`` on itself — with the MLP a unit."""
    recipe = fsdp2_lm(env, ApplyInForwardMLP)
    recipe.build = lambda: TinyLM(block=lambda: Block(mlp=ApplyInForwardMLP))
    recipe.tile = use_apply
    return untiled_vs_tiled(recipe, env)


def _mixed_precision(env: Env, unit: type) -> dict[str, Any]:
    return mixed_precision_metrics(env, lambda **options: fsdp2_lm(env, unit, **options))


@case
def fsdp2_mixed_precision_layer_units(env: Env) -> dict[str, Any]:
    return _mixed_precision(env, Block)


@case
def fsdp2_mixed_precision_mlp_units(env: Env) -> dict[str, Any]:
    return _mixed_precision(env, GLUMLP)
