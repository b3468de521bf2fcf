"""How the matrix's cases run on a rank, beyond the standard one (``Wrapper.run``: untiled and tiled trained alike):
torch.compile per block and its graphs counted, a checkpointed Llama's layer inputs offloaded or rebuilt by a recompute
chain, and the cases of their own kind — the anchors' per-shard backward as a negative control, a forced strategy
refused at the first call under a wrapper, one tensor-parallel MLP call's collectives, bad tensor-parallel plans."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

import tiledmlp
from tiledmlp.patching.state import STATE_ATTR

from .common import Env, compare, train, untiled_vs_tiled
from .counters import count_shards
from .models import Block, TinyLM, tiny_llama
from .titan import DIM, VOCAB, FeedForward, mlp_plan, world_meshes

if TYPE_CHECKING:
    from .matrix import Case

CaseRun = Callable[["Case", Env], dict[str, Any]]


# ----------------------------------------------------------------------------------------------
# torch.compile per block


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
    torch._dynamo.reset()
    counters.append(GraphCounter())
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        block.compile(backend=counters[-1])
    return model


def with_graph_counts(metrics: dict[str, Any], counters: list) -> dict[str, Any]:
    """``metrics`` plus the untiled and tiled runs' compiled graphs and tiled operators (``[untiled, tiled]``):
    the tiled call must be an operator in the graph, adding no graph break (so no graph)."""
    return {**metrics, "compiled_graphs": [c.graphs for c in counters], "tiled_ops": [c.tiled_ops for c in counters]}


# ----------------------------------------------------------------------------------------------
# A checkpointed Llama's layer inputs: on the host, or rebuilt by a recompute chain


@contextlib.contextmanager
def every_input_moved() -> Iterator[None]:
    """The tiny model's layer inputs (a few KB) offloaded all the same, by a fresh offloader; as it was after."""
    from tiledmlp.offload import checkpointing, host

    smallest = host.MIN_BYTES
    host.MIN_BYTES = 0
    checkpointing._OFFLOADERS.clear()
    try:
        yield
    finally:
        host.MIN_BYTES = smallest


def offloaded(case: Case, env: Env) -> dict[str, Any]:
    """The case (its tiling offloads: ``offload="cpu"``) trained alike, and the offloader's counts."""
    from tiledmlp.offload import checkpointing

    with every_input_moved():
        metrics = case.wrapper.run(case, env)
        stats = checkpointing.offloader_for(env.device).stats
    return {**metrics, "offload_regions": stats["regions"], "offload_restored": stats["restored"]}


class _Fixed:
    """A placement of the checkpointed layers' inputs decided in advance (what the memory plan would return), and what
    each layer keeps for its recompute."""

    def __init__(self, places: tuple[str, ...], keeps: tuple[frozenset[str], ...]) -> None:
        self.places, self.keeps = places, keeps

    def __call__(self, nbytes: int) -> tuple[tuple[str, ...], tuple[frozenset[str], ...]]:
        return self.places, self.keeps


def chained(keeps: tuple[frozenset[str], ...] = (frozenset(),) * 2, **options: Any) -> CaseRun:
    """``offload="auto"`` (with ``options``) with layer 0's input on the host and layer 1's recomputed from it in
    backward (a recompute chain), each layer keeping ``keeps`` for its recompute, against the untiled checkpointed
    model; reports the inputs freed and rebuilt, and the attention outputs kept and reused."""
    def run(case: Case, env: Env) -> dict[str, Any]:
        from tiledmlp.offload import checkpointing

        placements, tiled = [], []

        def tile(model: nn.Module) -> None:
            tiledmlp.enable_tiling(model, tile_tokens=16, offload="auto", **options)
            placement = checkpointing.layer_placement(model)
            placement.decide = _Fixed(("host", "recompute"), keeps)
            placements.append(placement)
            tiled.append(model)

        with every_input_moved():
            recipe = case.wrapper.recipe(case, env)
            recipe.tile = tile
            metrics = untiled_vs_tiled(recipe, env)
        modes = [m.__dict__["_tiledmlp_attention_mode"] for m in tiled[-1].modules()
                 if "_tiledmlp_attention_mode" in m.__dict__]
        return {**metrics, "freed": placements[-1].stats["freed"], "rebuilt": placements[-1].stats["rebuilt"],
                "kept": sum(m.kept for m in modes), "reused": sum(m.reused for m in modes)}
    return run


# ----------------------------------------------------------------------------------------------
# DDP: a control, a refusal


def anchor_control(case: Case, env: Env) -> dict[str, Any]:
    """The anchors' mechanism (the case's tiling switches it on): it either raises or trains differently."""
    recipe = case.wrapper.recipe(case, env)
    untiled = train(recipe, env, tiled=False)
    try:
        anchored = train(recipe, env, tiled=True)
    except RuntimeError as err:
        return {"anchor_error": str(err).splitlines()[0]}
    metrics = compare(untiled, anchored)
    return {"anchor_error": None, "param_rel": metrics["param_rel"], "update_rel": metrics["update_rel"]}


def refused_at_first_call(case: Case, env: Env) -> dict[str, Any]:
    """``strategy="plain"`` forced on the bare model, then the case's wrapper: the first call under it checks the forced
    strategy against the wrapping, as enable_tiling does on a wrapped model (before: accepted and reported plain)."""
    torch.manual_seed(0)
    model = tiledmlp.enable_tiling(TinyLM().to(env.device), strategy="plain", tile_tokens=16)
    wrapped = case.wrapper.wrap(env)(model)
    (batch,) = case.model.batches(env, 1)[0]
    try:
        wrapped(batch["ids"], batch["labels"])
    except ValueError as exc:
        return {"refused": str(exc)}
    return {"refused": ""}


# ----------------------------------------------------------------------------------------------
# Tensor parallelism: one MLP call, forward and backward, tiled and untiled


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


def tp_collectives_per_call(case: Case, env: Env) -> dict[str, Any]:
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
# Bad tensor-parallel plans: a ValueError that names the fix, the model left as it was


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


def tp_bad_plans(case: Case, env: Env) -> dict[str, Any]:
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

        torch.manual_seed(0)
        model = tiny_llama(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=1, num_key_value_heads=4,
                           max_position_embeddings=2048, attn_implementation=None).to(env.device)
        if not parallel_head:
            return model
        return parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1),
                                                                           use_local_output=False)})
    return build

