"""DistributedDataParallel cases (strategies ``ddp`` and ``no_sync``), run by ``worker.py``.

Buckets are capped at 2 KB, so every parameter is a bucket of its own and the communication hook
counts one all-reduce per parameter per synced backward: any gradient that reached the reducer twice,
or never, would change the count.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (
    GLUMLP, HIDDEN, ApplyBlock, Batch, Env, MLPFirst, Recipe, TinyLM, compare, ddp_sync, enable, float_batches,
    mlp_only_loss, registry, token_batches, train, untiled_vs_tiled, use_apply,
)

CASES, case = registry()
ONE_BUCKET_PER_PARAM_MB = 2 / 1024


def ddp(env: Env, **options: Any) -> Callable[[nn.Module], nn.Module]:
    return lambda model: DDP(model, device_ids=[env.local_rank] if env.on_gpu else None,
                             bucket_cap_mb=ONE_BUCKET_PER_PARAM_MB, **options)


def _lm(env: Env, micro: int = 1, **recipe: Any) -> Recipe:
    return Recipe(build=TinyLM, batches=token_batches(env, micro=micro), **recipe)


class GraphCounter:
    """An aot_eager Dynamo backend (the CPU suite checks the plumbing, not kernels) that counts the graphs it
    compiles and the tiled operators in them."""

    def __init__(self) -> None:
        from torch._dynamo.backends.registry import lookup_backend
        self.inner = lookup_backend("aot_eager")
        self.graphs = self.tiled_ops = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.tiled_ops += sum("tiledmlp.tiled_call" in str(n.target) for n in gm.graph.nodes)
        return self.inner(gm, example_inputs)


def compile_blocks(model: nn.Module, counters: list) -> nn.Module:
    """torch.compile every decoder block, with a new :class:`GraphCounter` appended to ``counters`` (Dynamo's
    caches emptied first, so each run counts its own graphs)."""
    from common import Block

    torch._dynamo.reset()
    counters.append(GraphCounter())
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        block.compile(backend=counters[-1])
    return model


def with_graph_counts(metrics: dict[str, Any], counters: list) -> dict[str, Any]:
    """``metrics`` plus the untiled and tiled runs' compiled graphs and tiled operators (``[untiled, tiled]``):
    the tiled call must be an operator in the graph, adding no graph break (so no graph)."""
    return {**metrics, "compiled_graphs": [c.graphs for c in counters], "tiled_ops": [c.tiled_ops for c in counters]}


@case
def ddp_compiled_blocks(env: Env) -> dict[str, Any]:
    """Tiling, then torch.compile per block, then DDP (its default buckets: Dynamo's DDPOptimizer refuses a
    first bucket larger than the others): trains like the compiled untiled model."""

    counters: list = []

    def wrap(model: nn.Module) -> nn.Module:
        return DDP(compile_blocks(model, counters), device_ids=[env.local_rank] if env.on_gpu else None)

    return with_graph_counts(untiled_vs_tiled(_lm(env, wrap=wrap, tile_before_wrap=True), env), counters)


@case
def ddp_default(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_lm(env, wrap=ddp(env), optimizer="adamw"), env)


@case
def ddp_find_unused_parameters(env: Env) -> dict[str, Any]:
    """A module forward never calls: the reducer must find it unused, and find the tiled weights used."""
    recipe = _lm(env, wrap=ddp(env, find_unused_parameters=True))
    recipe.build = lambda: TinyLM(unused=True)
    return untiled_vs_tiled(recipe, env)


@case
def ddp_static_graph(env: Env) -> dict[str, Any]:
    """static_graph=True while T — and so the shard count — changes every step (see shards_per_step)."""
    return untiled_vs_tiled(_lm(env, wrap=ddp(env, static_graph=True)), env)


@case
def ddp_gradient_as_bucket_view(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_lm(env, wrap=ddp(env, gradient_as_bucket_view=True)), env)


@case
def ddp_mlp_params_only(env: Env) -> dict[str, Any]:
    """DDP(mlp): the tiled MLP's parameters are all DDP has; its input needs no gradient."""
    recipe = Recipe(build=GLUMLP, batches=float_batches(env), wrap=ddp(env), loss_of=mlp_only_loss)
    return untiled_vs_tiled(recipe, env)


@case
def ddp_mlp_params_last(env: Env) -> dict[str, Any]:
    """The MLP runs first, so its gradients are the last the reducer waits for — the configuration where
    per-shard backward is silently wrong (see ``ddp_anchor_control``)."""
    recipe = Recipe(build=MLPFirst, batches=float_batches(env), wrap=ddp(env))
    return untiled_vs_tiled(recipe, env)


@case
def ddp_tile_before_wrap(env: Env) -> dict[str, Any]:
    """enable_tiling on the bare model, then DDP: the strategy is detected at run time."""
    return untiled_vs_tiled(_lm(env, wrap=ddp(env), tile_before_wrap=True), env)


@case
def ddp_forced_plain_before_wrap_refused(env: Env) -> dict[str, Any]:
    """``strategy="plain"`` forced on the bare model, then DDP: the first call under DDP checks the forced strategy
    against the wrapping, as enable_tiling does on a wrapped model (before: accepted and reported plain)."""
    from tiledmlp import enable_tiling

    torch.manual_seed(0)
    model = enable_tiling(TinyLM().to(env.device), strategy="plain", tile_tokens=16)
    wrapped = ddp(env)(model)
    batch = token_batches(env)[0][0]
    try:
        wrapped(batch["ids"], batch["labels"])
    except ValueError as exc:
        return {"refused": str(exc)}
    return {"refused": ""}


@case
def ddp_generic_form(env: Env) -> dict[str, Any]:
    """The generic form (module's own forward per shard) instead of the fast GLU form."""
    return untiled_vs_tiled(_lm(env, wrap=ddp(env), tile=enable(tile_tokens=16, form="generic")), env)


@case
def ddp_no_sync_accumulation(env: Env) -> dict[str, Any]:
    """3 micro-batches per step, the first 2 under ddp.no_sync(); strategy forced to 'no_sync'.

    ``accumulated_grad_rel`` compares the local gradients left by the two no_sync micro-batches.
    """
    recipe = _lm(env, micro=3, wrap=ddp(env), sync=ddp_sync, tile=enable(strategy="no_sync", tile_tokens=16))
    return untiled_vs_tiled(recipe, env)


@case
def ddp_no_sync_tile_before_wrap(env: Env) -> dict[str, Any]:
    """Gradient accumulation with tiling enabled ('auto') before wrapping. (DDP itself does not support
    no_sync() with static_graph=True.)"""
    recipe = _lm(env, micro=2, wrap=ddp(env), sync=ddp_sync, tile_before_wrap=True)
    return untiled_vs_tiled(recipe, env)


@case
def ddp_apply_tiled_mlp(env: Env) -> dict[str, Any]:
    """``apply_tiled_mlp(lambda m, x: m(x), mlp, x, ddp_safe=True)`` on unpatched MLPs."""
    recipe = _lm(env, wrap=ddp(env), tile=use_apply)
    recipe.build = lambda: TinyLM(block=ApplyBlock)
    return untiled_vs_tiled(recipe, env)


class ToyMoE(nn.Module):
    """Top-1 MoE with one module per expert (the pre-transformers-5 layout). A token goes to the expert
    of its first feature's band — (-inf, 0], (0, 1], (1, inf) — so which experts a rank uses, and which
    a shard uses, depends on the data."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, experts)
        self.experts = nn.ModuleList(GLUMLP() for _ in range(experts))
        self.register_buffer("bands", torch.tensor([0.0, 1.0]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights = self.gate(flat).softmax(-1)
        choice = torch.bucketize(flat[:, 0].contiguous(), self.bands)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, e:e + 1])
        return out.view_as(x)


def _experts_unused_on_rank0(batches: list[list[Batch]], env: Env) -> list[list[Batch]]:
    """On rank 0 every token gets a first feature <= 0: experts 1 and 2 see no token there."""
    if env.rank == 0:
        for (b,) in batches:
            b["x"][..., 0] = -b["x"][..., 0].abs()
    return batches


def _moe(env: Env, **ddp_options: Any) -> Recipe:
    return Recipe(build=lambda: MLPFirst(ToyMoE()), batches=_experts_unused_on_rank0(float_batches(env), env),
                  wrap=ddp(env, **ddp_options))


@case
def ddp_moe_experts_unused_on_a_rank(env: Env) -> dict[str, Any]:
    """find_unused_parameters=True with experts that rank 0 never uses and many shards do not use: each
    expert's gradient sums only the shards that routed tokens to it."""
    return untiled_vs_tiled(_moe(env, find_unused_parameters=True), env)


@case
def ddp_moe_experts_unused_without_find_unused(env: Env) -> dict[str, Any]:
    """Tiled under plain DDP, against untiled under find_unused_parameters=True (untiled needs it: rank 0
    never uses two experts). Tiled does not: the idle experts are inputs of the tiled node, whose
    backward gives them no gradient, and autograd still runs their AccumulateGrad — DDP's hook fires."""
    untiled = train(_moe(env, find_unused_parameters=True), env, tiled=False)
    return compare(untiled, train(_moe(env), env, tiled=True))


# ----------------------------------------------------------------------------------------------
# Negative control: the anchors' per-shard backward in the same configuration must be caught.


class _PerShardBackward(torch.autograd.Function):
    """The anchors' tiled MLP (DeepSpeed TiledMLP, Liger): backward calls autograd.backward per shard."""

    @staticmethod
    def forward(ctx, mlp: GLUMLP, x: torch.Tensor, shards: int) -> torch.Tensor:
        ctx.mlp, ctx.shards = mlp, shards
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([GLUMLP.forward(mlp, s) for s in x.chunk(shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)
        for xs, gs, dxs in zip(x.chunk(ctx.shards, dim=-2), grad.chunk(ctx.shards, dim=-2),
                               dx.chunk(ctx.shards, dim=-2)):
            leaf = xs.detach().requires_grad_(True)
            with torch.enable_grad():
                out = GLUMLP.forward(ctx.mlp, leaf)
            torch.autograd.backward(out, gs)  # AccumulateGrad and DDP's hook run once per shard
            dxs.copy_(leaf.grad)
        return None, dx, None


class AnchorMLP(GLUMLP):
    use_anchor = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PerShardBackward.apply(self, x, 4) if self.use_anchor else super().forward(x)


def _use_anchor(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, AnchorMLP):
            m.use_anchor = True


@case
def ddp_anchor_control(env: Env) -> dict[str, Any]:
    """The anchors' mechanism under ``ddp_mlp_params_last``'s configuration, to show the suite catches
    it: it either raises or trains differently. (Its input requires grad: without that, the anchors'
    Function output has no grad_fn at all.)"""
    recipe = Recipe(build=lambda: MLPFirst(AnchorMLP()), batches=float_batches(env), wrap=ddp(env),
                    tile=_use_anchor, loss_of=lambda m, b: m(b["x"].requires_grad_(True), b["y"]))
    untiled = train(recipe, env, tiled=False)
    try:
        anchored = train(recipe, env, tiled=True)
    except RuntimeError as err:
        return {"anchor_error": str(err).splitlines()[0]}
    metrics = compare(untiled, anchored)
    return {"anchor_error": None, "param_rel": metrics["param_rel"], "update_rel": metrics["update_rel"]}
