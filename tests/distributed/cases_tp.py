"""Tensor-parallel cases (``parallelize_module``), run by ``worker.py`` on 2 processes (TP=2 over the
world); ``cases_tp_world4.py`` runs some of them with TP=4 and the 2-D ones (FSDP2 over TP, DP=2 x TP=2,
defined here), all on the torchtitan-shaped model of ``titan.py``. Every case trains the model untiled and tiled under the same plan from the same seed.

DTensor's collectives are functional (``_c10d_functional``) and bypass ``torch.distributed``'s Python
functions, so TP recipes also count them with ``CommDebugMode`` (``dtensor_*`` keys).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

import tiledmlp
from tiledmlp.patching.state import STATE_ATTR

from common import (Batch, Env, Recipe, bf16_noise_metrics, count_shards, enable, mixed_precision_metrics, registry,
                    untiled_vs_tiled)
from titan import (DIM, VOCAB, BiasedMLP, FeedForward, Transformer, apply_fsdp, apply_tp, fused_glu, mlp_plan,
                   world_meshes)

CASES, case = registry()


def tp_batches(env: Env, dp_rank: int, steps: int = 3, batch: int = 2) -> list[list[Batch]]:
    """The same batches on every rank of a TP group (TP needs them), different across data-parallel
    ranks, in lengths divisible by the TP degree (sequence parallelism shards them) that differ from
    step to step and between data-parallel ranks (so do the shard counts)."""
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 * (dp_rank + 1) + s)
        t = (40, 56, 48, 64)[(s + dp_rank) % 4]
        ids = torch.randint(VOCAB, (batch, t + 1), generator=g)
        out.append([{"ids": ids[:, :-1].to(env.device), "labels": ids[:, 1:].to(env.device)}])
    return out


def titan(env: Env, tp: int, sequence_parallel: bool = True, mlp: Callable[[], nn.Module] = FeedForward,
          dtype: torch.dtype = torch.float32, **fsdp_options: Any) -> Recipe:
    """The torchtitan-shaped model under its TP plan on a ``tp``-wide mesh, and FSDP2 over the rest of the
    world (none when ``tp`` is the world size)."""
    dp_mesh, tp_mesh = world_meshes(env.device.type, env.world, tp)

    def wrap(model: nn.Module) -> nn.Module:
        apply_tp(model, tp_mesh, sequence_parallel)
        return model if dp_mesh is None else apply_fsdp(model, dp_mesh, **fsdp_options)

    dp_rank = 0 if dp_mesh is None else dp_mesh.get_local_rank()
    return Recipe(build=lambda: Transformer(mlp).to(dtype), batches=tp_batches(env, dp_rank), wrap=wrap,
                  count_dtensor=True, foreach=False)


@case
def tp_sequence_parallel(env: Env) -> dict[str, Any]:
    """torchtitan's plan: SequenceParallel norms, PrepareModuleInput(Shard(1) -> Replicate), w2 to Shard(1)."""
    return untiled_vs_tiled(titan(env, env.world), env)


@case
def tp_replicated(env: Env) -> dict[str, Any]:
    """No sequence parallelism: replicated hidden states, w2 all-reduces to Replicate."""
    return untiled_vs_tiled(titan(env, env.world, sequence_parallel=False), env)


@case
def tp_tile_before_parallelize(env: Env) -> dict[str, Any]:
    """Tiling enabled on the bare model, TP applied after: detected at run time."""
    recipe = titan(env, env.world)
    recipe.tile_before_wrap = True
    return untiled_vs_tiled(recipe, env)


@case
def tp_biased_plain_mlp(env: Env) -> dict[str, Any]:
    """A plain GELU MLP with biases: the down bias is added to the partial sum, before the reduce-scatter."""
    return untiled_vs_tiled(titan(env, env.world, mlp=BiasedMLP), env)


@case
def tp_fused_gate_up(env: Env) -> dict[str, Any]:
    """Phi-3's fused gate_up_proj, ColwiseParallel as a whole, with sequence parallelism."""
    return untiled_vs_tiled(titan(env, env.world, mlp=fused_glu), env)


@case
def tp_forced_strategy(env: Env) -> dict[str, Any]:
    recipe = titan(env, env.world)
    recipe.tile = enable(strategy="tp", tile_tokens=16)
    return untiled_vs_tiled(recipe, env)


@case
def tp_bf16(env: Env) -> dict[str, Any]:
    """bf16 parameters under TP, judged against bf16's own noise."""
    return bf16_noise_metrics(env, titan(env, env.world), titan(env, env.world, dtype=torch.bfloat16))


def fsdp2_over_tp(env: Env) -> dict[str, Any]:
    """torchtitan's 2-D: TP=2 inside, fully_shard per block and root over dp=world/2."""
    if env.world < 4:
        raise ValueError(f"fsdp2_over_tp needs 4 processes (DP=2 x TP=2), got {env.world}")
    return untiled_vs_tiled(titan(env, 2), env)


def fsdp2_over_tp_bf16(env: Env) -> dict[str, Any]:
    """2-D with FSDP2's bf16 mixed precision (fp32 reduction)."""
    if env.world < 4:
        raise ValueError(f"fsdp2_over_tp_bf16 needs 4 processes, got {env.world}")
    return mixed_precision_metrics(env, lambda **fsdp_options: titan(env, 2, **fsdp_options))


# ----------------------------------------------------------------------------------------------
# One MLP call: its collectives, forward and backward, tiled and untiled


def _one_call(mlp: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    def counts(mode: CommDebugMode) -> dict[str, int]:
        return {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items() if n}

    x = x.detach().requires_grad_()
    with count_shards(True) as shards, CommDebugMode() as fwd:
        y = mlp(x)
    with CommDebugMode() as bwd:
        y.float().square().sum().backward()
    return {"forward": counts(fwd), "backward": counts(bwd), "shards": shards["shards"],
            "out": y.detach().float(), "dx": x.grad.float()}


@case
def tp_collectives_per_call(env: Env) -> dict[str, Any]:
    """One tiled and one untiled MLP call, with and without sequence parallelism: the collectives of each
    pass, the shard count, and how far the outputs and input gradients are apart."""
    from torch.distributed.tensor.parallel import parallelize_module

    _, tp_mesh = world_meshes(env.device.type, env.world, env.world)
    out: dict[str, Any] = {}

    def build(sp: bool) -> nn.Module:
        torch.manual_seed(0)
        mlp = FeedForward().to(env.device)
        plan = mlp_plan(mlp, sp)
        prepare = plan.pop("", None)
        parallelize_module(mlp, tp_mesh, plan)
        return mlp if prepare is None else parallelize_module(mlp, tp_mesh, prepare)

    for sp in (False, True):
        untiled, tiled = build(sp), tiledmlp.enable_tiling(build(sp), tile_tokens=16)
        torch.manual_seed(1 + (env.rank if sp else 0))  # sequence shards differ per rank, replicated input not
        x = torch.randn(2, 48 // (env.world if sp else 1), DIM, device=env.device)
        ref, got = _one_call(untiled, x), _one_call(tiled, x)
        key = "sequence_parallel" if sp else "replicated"
        # what describe() says: identified by the probe over gathered weights, scratch of the local slice
        bare = tiledmlp.describe(tiledmlp.enable_tiling(FeedForward(), tile_tokens=16), seq_len=1024)[""]
        out[f"described_{key}"] = [[i.form, i.strategy, i.computes, i.scratch_bytes, bare.scratch_bytes]
                                   for i in tiledmlp.describe(tiled, seq_len=1024).values()]
        out[key] = {"untiled": {k: ref[k] for k in ("forward", "backward")},
                    "tiled": {k: got[k] for k in ("forward", "backward", "shards")},
                    "out_rel": float((got["out"] - ref["out"]).abs().max() / ref["out"].abs().max()),
                    "dx_rel": float((got["dx"] - ref["dx"]).abs().max() / ref["dx"].abs().max())}
    return out


# ----------------------------------------------------------------------------------------------
# Bad plans: a ValueError that names the fix, the model left as it was


def _refusal(build: Callable[[], nn.Module], **options: Any) -> dict[str, Any]:
    model = build()
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    try:
        tiledmlp.enable_tiling(model, **options)
        message = None
    except ValueError as exc:
        message = str(exc)
    untouched = all(STATE_ATTR not in m.__dict__ and m.__dict__.get("forward") is forwards[n]
                    for n, m in model.named_modules())
    return {"message": message, "untouched": untouched}


@case
def tp_bad_plans(env: Env) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _, mesh = world_meshes(env.device.type, env.world, env.world)

    def planned(plan: dict[str, Any]) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            torch.manual_seed(0)
            return parallelize_module(FeedForward().to(env.device), mesh, plan)
        return build

    def manual() -> nn.Module:  # DTensor weights, no plan
        torch.manual_seed(0)
        mlp = FeedForward().to(env.device)
        for lin, placement in ((mlp.w1, Shard(0)), (mlp.w3, Shard(0)), (mlp.w2, Shard(1))):
            lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [placement]))
        return mlp

    col, row = ColwiseParallel, RowwiseParallel
    return {
        "down_colwise": _refusal(planned({"w1": col(), "w3": col(), "w2": col()})),
        "up_rowwise": _refusal(planned({"w1": col(), "w3": row(), "w2": row()})),
        "gate_up_differ": _refusal(planned({"w1": col(), "w3": col(input_layouts=Shard(1)), "w2": row()})),
        "intermediate_replicated": _refusal(planned({"w1": col(output_layouts=Replicate()),
                                                     "w3": col(output_layouts=Replicate()), "w2": row()})),
        "no_plan": _refusal(manual),
        "forced_plain": _refusal(planned({"w1": col(), "w3": col(), "w2": row()}), strategy="plain"),
        "generic_form": _refusal(planned({"w1": col(), "w3": col(), "w2": row()}), form="generic"),
        "vocab_parallel_loss": _refusal(_tp_causal_lm(env, mesh), loss=True),
        "apply_tiled_mlp": _apply_refusal(planned({"w1": col(), "w3": col(), "w2": row()}), env),
        "vocab_parallel_loss_tiled_before": _tiled_before_refusal(env, mesh),
    }


def _tiled_before_refusal(env: Env, mesh: Any) -> dict[str, Any]:
    """``loss=True`` on the bare model, then a vocab-sharded head: refused at the call that would tile it."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = _tp_causal_lm(env, mesh, parallel_head=False)()
    tiledmlp.enable_tiling(model, loss=True)
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    ids = torch.randint(VOCAB, (1, 16), device=env.device)
    try:
        model(input_ids=ids, labels=ids)
        return {"message": None, "untouched": True}
    except ValueError as exc:
        return {"message": str(exc), "untouched": True}


def _apply_refusal(build: Callable[[], nn.Module], env: Env) -> dict[str, Any]:
    mlp = build()
    try:
        tiledmlp.apply_tiled_mlp(lambda m, x: m(x), mlp, torch.randn(2, 8, DIM, device=env.device))
        return {"message": None, "untouched": True}
    except ValueError as exc:
        return {"message": str(exc), "untouched": True}


def _tp_causal_lm(env: Env, mesh: Any, parallel_head: bool = True) -> Callable[[], nn.Module]:
    """A tiny Hugging Face Llama whose LM head is ColwiseParallel (loss_parallel style), or not yet."""
    def build() -> nn.Module:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
        from models import tiny_llama

        torch.manual_seed(0)
        model = tiny_llama(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=1, num_key_value_heads=4,
                           max_position_embeddings=2048, attn_implementation=None).to(env.device)
        if not parallel_head:
            return model
        return parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1),
                                                                           use_local_output=False)})
    return build

