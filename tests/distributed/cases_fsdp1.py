"""FSDP1 (``FullyShardedDataParallel``) cases, run by ``worker.py``: flat parameters
(``use_orig_params=False``, the MLP's weights are views of a flat parameter) and original parameters,
with the unit at the root, the decoder layer or the MLP; gradient accumulation under ``no_sync()``;
tiling before and after wrapping.

FSDP1 needs ``device_id``: with ``device_id=cpu`` it runs on gloo (torch >= 2.13 here), with
``cuda:<rank>`` on NCCL.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from common import (
    Block, Env, ForwardApplyBlock, GLUMLP, Recipe, TinyLM, ddp_sync, enable, registry, token_batches, untiled_vs_tiled,
    use_apply,
)

CASES, case = registry()


def fsdp1(env: Env, unit: Optional[type], use_orig_params: bool) -> Callable[[nn.Module], nn.Module]:
    """Wrap the root, and every ``unit`` module as its own FSDP instance (None: the root only)."""
    policy = ModuleWrapPolicy({unit}) if unit is not None else None
    return lambda model: FSDP(model, device_id=env.device, auto_wrap_policy=policy, use_orig_params=use_orig_params)


def _lm(env: Env, unit: Optional[type], use_orig_params: bool, micro: int = 1, **recipe: Any) -> Recipe:
    return Recipe(build=TinyLM, batches=token_batches(env, micro=micro), wrap=fsdp1(env, unit, use_orig_params),
                  **recipe)


@case
def fsdp1_flat_root(env: Env) -> dict[str, Any]:
    """One flat parameter for the whole model: the MLP's weights are views into it."""
    return untiled_vs_tiled(_lm(env, None, False), env)


@case
def fsdp1_flat_layer_units(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_lm(env, Block, False, optimizer="adamw"), env)


@case
def fsdp1_flat_mlp_units(env: Env) -> dict[str, Any]:
    """The MLP is wrapped itself: tiling patches the module inside the FSDP wrapper, not the wrapper."""
    return untiled_vs_tiled(_lm(env, GLUMLP, False), env)


@case
def fsdp1_orig_params_root(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_lm(env, None, True), env)


@case
def fsdp1_orig_params_layer_units(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_lm(env, Block, True), env)


@case
def fsdp1_orig_params_mlp_units(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_lm(env, GLUMLP, True), env)


@case
def fsdp1_flat_tile_before_wrap(env: Env) -> dict[str, Any]:
    """Tiled before wrapping: FSDP1 then replaces the weights by flat-parameter views, seen at run time."""
    return untiled_vs_tiled(_lm(env, Block, False, tile_before_wrap=True), env)


@case
def fsdp1_orig_params_tile_before_wrap(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_lm(env, None, True, tile_before_wrap=True), env)


@case
def fsdp1_no_sync_accumulation(env: Env) -> dict[str, Any]:
    """3 micro-batches per step, the first 2 under FSDP.no_sync(); strategy forced to 'no_sync'."""
    recipe = _lm(env, Block, False, micro=3, sync=ddp_sync, tile=enable(strategy="no_sync", tile_tokens=16))
    return untiled_vs_tiled(recipe, env)


@case
def fsdp1_no_sync_orig_params(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_lm(env, GLUMLP, True, micro=2, sync=ddp_sync), env)


@case
def fsdp1_apply_tiled_mlp_orig_params(env: Env) -> dict[str, Any]:
    """``apply_tiled_mlp`` from the decoder layer's forward, original parameters. (With flat
    parameters it is refused: the weights are not parameters of the module there.)"""
    recipe = _lm(env, Block, True, tile=use_apply)
    recipe.build = lambda: TinyLM(block=ForwardApplyBlock)
    return untiled_vs_tiled(recipe, env)

