"""torch's ring context parallelism (``context_parallel``), GPUs only (its SDPA ring has no CPU kernels): FSDP2 over
a ``dp_shard x cp`` mesh flattened, as torchtitan and accelerate build it; a Llama with grouped KV heads made
runnable and masks dropped for ``is_causal`` by ``tiledmlp.ring_ready``, as accelerate's hooks do; the loss of
each whole sequence from ``tiledmlp.sequence_loss``. Trained untiled and tiled, with and without the ring's load
balancing (head-tail chunks), against one process on the whole sequences (``cases_sp.reference``); and the
``Trainer`` with accelerate's ``ParallelismConfig(cp_size=world)``, untiled against tiled. Launched by ``test_cp.py``
where there are enough GPUs."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tiledmlp
from .cases_sp import LR, MICRO, _rel, batches, llama, reference
from .common import Env, registry
from .trainer_run import trainer_run

CASES, case = registry()
# torch's ring merges each step's log-sum-exp with its running one; the efficient-attention kernel (float32 here)
# pads it to a multiple of 32 tokens, and the merge then fails on shape ("size of tensor a (32) must match ... (24)")
# unless every chunk a rank attends with is a multiple of 32: 2 chunks per cp rank under load balancing.
T = 2 * 2 * 64


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
            for n, p in model.named_parameters()}


def _train(env: Env, tiled: bool, balanced: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    mesh = init_device_mesh(env.device.type, (env.world // 2, 2), mesh_dim_names=("dp_shard", "cp"))
    flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    model = llama(env.device)
    tiledmlp.ring_ready(model)  # KV heads repeated (the ring has no grouped-query path), masks dropped for is_causal
    for layer in model.model.layers:
        fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)
    if tiled:
        tiledmlp.enable_tiling(model, tile_tokens=8, loss_scratch_mib=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    group = mesh["cp"].get_group()
    saved = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = balanced
    try:
        for micro in batches(T):
            for ids, labels in micro:
                ids = ids.to(env.device)
                shift = F.pad(labels.to(env.device), (0, 1), value=-100)[:, 1:].contiguous()  # before the split
                positions = torch.arange(T, device=env.device)[None].contiguous()
                buffers = [ids, shift, positions]
                # The buffers are cut in place: this rank's chunk(s) of the sequence, global positions kept.
                with context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                      no_restore_buffers=set(buffers)):
                    loss = tiledmlp.sequence_loss(model, shift, group, input_ids=ids, position_ids=positions)
                    (loss / MICRO).backward()
            opt.step()
            opt.zero_grad()
    finally:
        _cp_options.enable_load_balance = saved
    return _full_params(model), tiledmlp.tiled_modules(model)


def _compare(env: Env, balanced: bool) -> dict[str, Any]:
    want = {n: p.detach().float().cpu() for n, p in reference(env.device, T).named_parameters()}
    untiled, _ = _train(env, tiled=False, balanced=balanced)
    tiled, strategies = _train(env, tiled=True, balanced=balanced)
    return {"untiled_vs_reference": _rel(untiled, want), "tiled_vs_untiled": _rel(tiled, untiled),
            "tiled_vs_reference": _rel(tiled, want), "moved": _rel(want, {n: p.detach().float().cpu()
                                                                         for n, p in llama().named_parameters()}),
            "strategies": sorted(set(strategies.values()))}


@case
def cp_fsdp2(env: Env) -> dict[str, Any]:
    """Contiguous chunks: rank r holds tokens [r T/2, (r+1) T/2) of each sequence."""
    return _compare(env, balanced=False)


@case
def cp_fsdp2_load_balanced(env: Env) -> dict[str, Any]:
    """Head-tail chunks (the ring's default): ranks hold different numbers of valid labels, the first none."""
    return _compare(env, balanced=True)


def _trainer_run(env: Env, tiled: bool) -> tuple[float, dict[str, torch.Tensor], dict[str, str]]:
    """Two ``Trainer`` steps with accelerate's ``ParallelismConfig(cp_size=world)``: FSDP2 over the flattened
    ``dp_shard x cp`` mesh, each sequence cut by ``context_parallel`` (load-balanced) with the labels the Trainer
    shifts before the cut, accelerate's hooks dropping the masks; SGD, no clipping, float32."""
    from accelerate.utils import ParallelismConfig

    model = llama()
    tiledmlp.repeat_kv_heads(model)  # torch's ring has no grouped-query path
    if tiled:
        tiledmlp.enable_tiling(model, tile_tokens=8, loss_scratch_mib=0.01)
    data = [{"input_ids": ids[0], "labels": labels[0]} for micro in batches(T) for ids, labels in micro]
    return trainer_run(model, data, ParallelismConfig(dp_shard_size=1, cp_size=env.world), LR,
                       lambda trainer: _full_params(trainer.model), fsdp="full_shard",
                       fsdp_config={"version": 2, "reshard_after_forward": True,
                                    "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})


@case
def trainer_cp(env: Env) -> dict[str, Any]:
    """The Trainer with ``cp_size`` = the world: tiled trains as untiled under it (loss and parameters)."""
    untiled_loss, untiled, _ = _trainer_run(env, tiled=False)
    tiled_loss, tiled, strategies = _trainer_run(env, tiled=True)
    return {"losses": [untiled_loss, tiled_loss], "tiled_vs_untiled": _rel(tiled, untiled),
            "moved": _rel(untiled, {n: p.detach().float().cpu() for n, p in llama().named_parameters()}),
            "strategies": sorted(set(strategies.values()))}
