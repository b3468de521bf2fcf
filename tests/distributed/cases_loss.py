"""Tiled loss (``enable_tiling(model, loss=True)``) cases, run by ``worker.py``: a tiny Hugging Face
Llama, untied and with tied embeddings, trained untiled and tiled under DDP (default,
find_unused_parameters, static_graph with a different sequence length every step, no_sync
accumulation), FSDP2 (the root unit owning lm_head, lm_head its own unit with reshard True/False, bf16
mixed precision, gradient accumulation) and FSDP1 (flat and original parameters).

The loss's scratch budget is tiny, so its call is cut into several shards (as the MLPs are): the
harness's shard count covers it. ``fused`` cases finish the head's gradients in forward (the default
at real sizes); ``recompute`` cases chunk the vocabulary and recompute the logits in backward.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from cases_ddp import ddp
from cases_fsdp1 import fsdp1
from common import (Env, Recipe, ddp_sync, enable, fsdp2_sync, hf_batches, mixed_precision_metrics, registry,
                    untiled_vs_tiled)
from models import tiny_llama

CASES, case = registry()
VOCAB = 96
#: bytes per logits row: 96 * 4 (float32), so 8 KiB of budget (3/4 for logits) cuts ~16-token shards
SCRATCH_MIB = 8 / 1024


def llama(tied: bool = False) -> Callable[[], nn.Module]:
    return lambda: tiny_llama(vocab_size=VOCAB, tie_word_embeddings=tied)


def tile(mode: str = "fused", **options: Any) -> Callable[[nn.Module], None]:
    return enable(loss=True, tile_tokens=16, loss_scratch_mib=SCRATCH_MIB, loss_mode=mode, **options)


def hf_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(**batch).loss


def _recipe(env: Env, wrap: Callable[[nn.Module], nn.Module], tied: bool = False, mode: str = "fused",
            micro: int = 1, **recipe: Any) -> Recipe:
    return Recipe(build=llama(tied), batches=hf_batches(env, VOCAB, micro=micro), wrap=wrap, tile=tile(mode),
                  loss_of=hf_loss, **recipe)


def fsdp2_llama(env: Env, head_unit: bool = False, **options: Any) -> Callable[[nn.Module], nn.Module]:
    """fully_shard every decoder layer, lm_head too when ``head_unit``, then the root (which then owns
    the embeddings, the final norm and, without ``head_unit``, lm_head)."""
    mesh = init_device_mesh(env.device.type, (env.world,))

    def wrap(model: nn.Module) -> nn.Module:
        for m in [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]:
            fully_shard(m, mesh=mesh, **options)
        if head_unit:
            fully_shard(model.lm_head, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        return model

    return wrap


# ----------------------------------------------------------------------------------------------
# DDP


@case
def loss_ddp(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, ddp(env)), env)


@case
def loss_ddp_tied(env: Env) -> dict[str, Any]:
    """The shared embedding/head weight gets the embedding's and the head's gradient, once each."""
    return untiled_vs_tiled(_recipe(env, ddp(env), tied=True), env)


@case
def loss_ddp_find_unused_parameters(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, ddp(env, find_unused_parameters=True)), env)


@case
def loss_ddp_static_graph(env: Env) -> dict[str, Any]:
    """static_graph=True while the sequence length — so the loss's shard count — changes every step."""
    return untiled_vs_tiled(_recipe(env, ddp(env, static_graph=True), tied=True), env)


@case
def loss_ddp_no_sync_accumulation(env: Env) -> dict[str, Any]:
    """3 micro-batches per step, the first 2 under no_sync(); forced 'no_sync'."""
    recipe = _recipe(env, ddp(env), micro=3, sync=ddp_sync)
    recipe.tile = tile(strategy="no_sync")
    return untiled_vs_tiled(recipe, env)


@case
def loss_ddp_tile_before_wrap(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, ddp(env), tile_before_wrap=True), env)


@case
def loss_ddp_recompute(env: Env) -> dict[str, Any]:
    """Vocabulary chunks and logits recomputed in backward."""
    return untiled_vs_tiled(_recipe(env, ddp(env), tied=True, mode="recompute"), env)


# ----------------------------------------------------------------------------------------------
# FSDP2


@case
def loss_fsdp2_root_owns_head(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, fsdp2_llama(env)), env)


@case
def loss_fsdp2_root_owns_tied_head(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, fsdp2_llama(env), tied=True), env)


@case
def loss_fsdp2_head_unit(env: Env) -> dict[str, Any]:
    """lm_head its own unit, resharded after forward: the loss runs in the root's forward, after the
    head's own call, so the strategy keeps the head's unit gathered from that call until the loss has
    run (FSDP2Strategy.hold_gathered): the untiled collectives, not one all-gather more."""
    return untiled_vs_tiled(_recipe(env, fsdp2_llama(env, head_unit=True)), env)


@case
def loss_fsdp2_head_unit_keep_unsharded(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, fsdp2_llama(env, head_unit=True, reshard_after_forward=False)), env)


@case
def loss_fsdp2_head_unit_recompute(env: Env) -> dict[str, Any]:
    """Recompute mode with a resharded head unit: backward gathers the head again to recompute."""
    return untiled_vs_tiled(_recipe(env, fsdp2_llama(env, head_unit=True), mode="recompute"), env)


@case
def loss_fsdp2_no_sync_accumulation(env: Env) -> dict[str, Any]:
    recipe = _recipe(env, fsdp2_llama(env, head_unit=True), micro=2, sync=fsdp2_sync)
    return untiled_vs_tiled(recipe, env)


@case
def loss_fsdp2_tile_before_wrap(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, fsdp2_llama(env, head_unit=True), tile_before_wrap=True), env)


def _mixed_precision(env: Env, head_unit: bool, tied: bool) -> dict[str, Any]:
    return mixed_precision_metrics(env, lambda **options: _recipe(env, fsdp2_llama(env, head_unit, **options), tied=tied))


@case
def loss_fsdp2_mixed_precision_head_unit(env: Env) -> dict[str, Any]:
    return _mixed_precision(env, head_unit=True, tied=False)


@case
def loss_fsdp2_mixed_precision_tied(env: Env) -> dict[str, Any]:
    return _mixed_precision(env, head_unit=False, tied=True)


# ----------------------------------------------------------------------------------------------
# FSDP1


@case
def loss_fsdp1_flat(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, fsdp1(env, LlamaDecoderLayer, use_orig_params=False)), env)


@case
def loss_fsdp1_flat_tied(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, fsdp1(env, LlamaDecoderLayer, use_orig_params=False), tied=True), env)


@case
def loss_fsdp1_orig_params(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, fsdp1(env, LlamaDecoderLayer, use_orig_params=True), tied=True), env)


@case
def loss_fsdp1_no_sync_accumulation(env: Env) -> dict[str, Any]:
    recipe = _recipe(env, fsdp1(env, LlamaDecoderLayer, use_orig_params=False), micro=2, sync=ddp_sync)
    return untiled_vs_tiled(recipe, env)
