"""Sequence parallelism cases, run by ``worker.py``: one sequence split across every rank by DeepSpeed's Ulysses
(``UlyssesSPAttentionHF`` registered with transformers: an all-to-all around sdpa; gloo has ``all_to_all``, so it
runs on CPU processes), without an engine and under DeepSpeed ZeRO 1/2/3 engines with ``sequence_parallel_size``
set, against one process training on the whole sequences untiled (eager attention, no split: the reference).

Every case trains a tiny Llama three steps (SGD, two micro-batches per step: gradient accumulation) on sequences
whose prompt is masked (-100) over 60% of the tokens, so the first rank (first two at 4 ranks) holds no valid label
— the case the anchors get wrong. A rank computes its part's loss from labels shifted before the split
(``shift_labels``) in one of two ways:

* ``trainer``: the model's loss (tiled per rank) gathered and weighted by valid labels, as the ``Trainer``'s
  ``deepspeed_sp_compute_loss`` does (differentiable all-gather);
* ``sequence_loss``: ``tiledmlp.sequence_loss(model, shift_labels, group, ...)``, the model called through its
  engine.

Metrics: each run's parameters against the reference after training (``*_rel``), the tiled run against the
untiled one under the same split and loss (``tiled_vs_untiled``), the strategies ``tiled_modules`` reports.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tiledmlp
from .common import Env, registry
from .models import tiny_llama
from .trainer_run import trainer_run
from tiledmlp.attention.layers import attention_layers
from tiledmlp.core.compat import enable_checkpointing

CASES, case = registry()
VOCAB, T, STEPS, MICRO, LR = 96, 48, 3, 2, 0.1
PROMPT = 0.6  # share of each sequence's first tokens whose labels are masked


def llama(device: torch.device = torch.device("cpu"), heads: int = 4, kv_heads: int = 2) -> nn.Module:
    """The tiny Llama 64 wide with sdpa attention (the one Ulysses wraps), seeded."""
    torch.manual_seed(0)
    return tiny_llama(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=2048, attn_implementation="sdpa",
                      use_cache=False).to(device)


def batches(length: int = T) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][micro-batch] -> (input_ids, labels)`` of whole sequences of ``length``, the same on every rank."""
    out = []
    for step in range(STEPS):
        micro = []
        for i in range(MICRO):
            ids = torch.randint(VOCAB, (1, length), generator=torch.Generator().manual_seed(100 * step + i))
            labels = ids.clone()
            labels[:, :int(PROMPT * length)] = -100
            micro.append((ids, labels))
        out.append(micro)
    return out


def reference(device: torch.device, length: int = T, **shape: int) -> nn.Module:
    """One process, the whole sequences, untiled, eager attention (not the one Ulysses replaces)."""
    model = llama(device, **shape)
    model.config._attn_implementation = "eager"
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for micro in batches(length):
        for ids, labels in micro:
            (model(input_ids=ids.to(device), labels=labels.to(device)).loss / MICRO).backward()
        opt.step()
        opt.zero_grad()
    return model


@contextlib.contextmanager
def ulysses(env: Env, split: Optional[int] = None, **shape: int) -> Iterator[Any]:
    """DeepSpeed's Ulysses over ``split`` consecutive ranks (default every rank; its mpu), undone on exit: sdpa
    restored, its groups released."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    deepspeed.init_distributed(dist_backend=dist.get_backend())
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        yield UlyssesSPAttentionHF.register_with_transformers(llama(**shape), "sdpa", split or env.world,
                                                              micro_batch_size=1)
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
        parallel_state_sp._release_sequence_parallel_groups()
        gc.collect()


def _part(env: Env, t: torch.Tensor) -> torch.Tensor:
    size = t.shape[1] // env.world
    return t[:, env.rank * size:(env.rank + 1) * size]


def _local_loss(model: nn.Module, env: Env, group: Any, ids: torch.Tensor, labels: torch.Tensor,
                how: str) -> torch.Tensor:
    """This rank's loss of the whole sequence (see the module docstring for ``how``)."""
    ids, labels = ids.to(env.device), labels.to(env.device)
    shift = F.pad(labels, (0, 1), value=-100)[:, 1:]  # shifted before the split
    positions = torch.arange(T, device=env.device)[None]
    part = dict(input_ids=_part(env, ids), position_ids=_part(env, positions))
    local = _part(env, shift)
    if how == "sequence_loss":
        return tiledmlp.sequence_loss(model, local, group, **part)
    loss = model(**part, labels=local, shift_labels=local).loss
    good = (local != -100).sum()
    losses = torch.stack(torch.distributed.nn.functional.all_gather(loss, group=group))
    goods = torch.stack(torch.distributed.nn.functional.all_gather(good, group=group))
    return (torch.where(goods > 0, losses, torch.zeros_like(losses)) * goods).sum() / goods.sum().clamp(min=1)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("module."): p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def _rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[n] - w).abs().max() / w.abs().max().clamp_min(1e-30)) for n, w in want.items())


def train_without_engine(env: Env, group: Any, how: str, tiled: bool, shape: dict[str, int],
                         keeps: Optional[frozenset] = None, **options: Any) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """The split run with no engine: gradients averaged over the group by hand (what DDP over it does); ``shape``
    goes to :func:`llama`, ``options`` to ``enable_tiling``. ``keeps``: checkpointed layers (non-reentrant), their
    inputs kept on the device and these kinds kept for their recompute (``offload="auto"``'s placement, fixed)."""
    model = llama(env.device, **shape)
    if keeps is not None:
        enable_checkpointing(model)
    if tiled:
        tiledmlp.enable_tiling(model, tile_tokens=8, loss_scratch_mib=0.01, **options)
    if keeps:
        from tiledmlp.offload import checkpointing, host

        host.MIN_BYTES = 0  # the tiny model's layer inputs are a few KB: placed all the same

        layers = model.config.num_hidden_layers
        checkpointing.layer_placement(model).decide = lambda nbytes: (("gpu",) * layers, (keeps,) * layers)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for micro in batches():
        for ids, labels in micro:
            (_local_loss(model, env, group, ids, labels, how) / MICRO).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= env.world
        opt.step()
        opt.zero_grad()
    return _params(model), tiledmlp.tiled_modules(model), attention_layers(model)


def train_with_engine(env: Env, mpu: Any, stage: int, how: str, tiled: bool) -> tuple[dict[str, torch.Tensor], dict,
                                                                                      dict]:
    """The split run under a DeepSpeed ZeRO engine with ``sequence_parallel_size`` = the world (no clipping)."""
    import deepspeed

    model = llama(env.device)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": MICRO, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "sequence_parallel_size": env.world}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=config, mpu=mpu)
    if tiled:
        tiledmlp.enable_tiling(engine, tile_tokens=8, loss_scratch_mib=0.01)
    group = mpu.get_sequence_parallel_group()
    for micro in batches():
        for ids, labels in micro:
            engine.backward(_local_loss(engine, env, group, ids, labels, how))
            engine.step()
    strategies = tiledmlp.tiled_modules(engine)
    params = _gathered_params(engine.module)
    engine.destroy()
    return params, strategies, {}


def _metrics(env: Env, runs: dict[str, tuple[dict[str, torch.Tensor], dict, dict]], **shape: int) -> dict[str, Any]:
    want = _params(reference(env.device, **shape))
    metrics: dict[str, Any] = {f"{name}_rel": _rel(params, want) for name, (params, _, _) in runs.items()}
    for name, (params, strategies, attention) in runs.items():
        if name.startswith("tiled"):
            metrics[f"{name}_strategies"] = sorted(set(strategies.values()))
            metrics[f"{name}_attention"] = sorted(set(attention.values()))
            twin = "untiled" + name.removeprefix("tiled")
            if twin in runs:
                metrics[f"{name}_vs_untiled"] = _rel(params, runs[twin][0])
    return metrics


def _no_engine(env: Env, shape: Optional[dict[str, int]] = None, **options: Any) -> dict[str, Any]:
    shape = shape or {}
    with ulysses(env, **shape) as mpu:
        group = mpu.get_sequence_parallel_group()
        runs = {f"{'tiled' if tiled else 'untiled'}_{how}": train_without_engine(env, group, how, tiled, shape,
                                                                                 **options)
                for how in ("trainer", "sequence_loss") for tiled in (False, True)}
    return _metrics(env, runs, **shape)


@case
def ulysses_no_engine(env: Env) -> dict[str, Any]:
    return _no_engine(env)


@case
def ulysses_no_engine_attention(env: Env) -> dict[str, Any]:
    """``attention=True`` and ``norms=True`` under Ulysses, q/k/v keeping the input norm's input. 4 heads, 2 KV
    heads: over 2 ranks one KV head a rank, Ulysses' call computed by ``tiledmlp.attention.ulysses`` (one slot);
    over 4 Ulysses repeats the KV heads, so it runs its own exchanges and this path takes the SDPA call it makes."""
    return _no_engine(env, attention=True, norms=True, scratch_mib=1e-4)


@case
def ulysses_attention_slots(env: Env) -> dict[str, Any]:
    """``attention=True`` under Ulysses with 8 heads and 4 KV heads: over 2 ranks two KV-head slots a rank, over 4
    one, each exchanged and computed in turn (``tiledmlp.attention.ulysses``)."""
    return _no_engine(env, shape={"heads": 8, "kv_heads": 4}, attention=True, norms=True, scratch_mib=1e-4)


@case
def ulysses_attention_kept(env: Env) -> dict[str, Any]:
    """Checkpointed layers under Ulysses, ``offload="auto"`` keeping every layer's attention output for its recompute
    (``tiledmlp.attention.ulysses`` keeps the rank's output and the exchanged log-sum-exps; the recompute exchanges
    and computes nothing): trained bit for bit as with plain checkpointing (``kept_vs_plain`` 0)."""
    from tiledmlp.core.regions import ATTENTION

    shape = {"heads": 8, "kv_heads": 4}
    options = dict(attention=True, norms=True, scratch_mib=1e-4)
    with ulysses(env, **shape) as mpu:
        group = mpu.get_sequence_parallel_group()
        plain = train_without_engine(env, group, "sequence_loss", True, shape, keeps=frozenset(), **options)
        kept = train_without_engine(env, group, "sequence_loss", True, shape, keeps=frozenset({ATTENTION}),
                                    offload="auto", **options)
    return {"kept_vs_plain": max(float((kept[0][n] - p).abs().max()) for n, p in plain[0].items()),
            "plain_rel": _rel(plain[0], _params(reference(env.device, **shape))),
            "kept_attention": sorted(set(kept[2].values())), "plain_attention": sorted(set(plain[2].values()))}


@case
def ulysses_plan_meets_measured(env: Env) -> dict[str, Any]:
    """``plan_memory`` under Ulysses against every measured row of ``tiledmlp.attention.ulysses`` (``bench_sp.py``'s
    ``tiled+offload+norms+attn`` rows on two GPUs under FSDP2, read from ``benchmarks/results``): the 8B shape (the
    1B where the file's tag says ``_1b_``) built on the meta device, sharded by FSDP2 over these ranks as the
    benchmark shards it (nothing allocated); each row's device peak against the plan's (relative errors)."""
    import csv
    import sys
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    rows = [(path.name, row) for path in sorted(results.glob("bench_sp_*.csv")) for row in csv.DictReader(path.open())
            if row["variant"] == "tiled+offload+norms+attn" and row.get("shard") == "fsdp2"
            and row["world"] == str(env.world) and row["peak_gib"] not in ("oom", "error")
            # rows of tiledmlp before 0.4 ran Ulysses' own exchanges (tiledmlp took its calls from 0.4 on)
            and tuple(int(n) for n in row["tiledmlp"].split(".")[:2]) >= (0, 4)]
    if not rows:
        return {"rows": 0}
    sys.path.insert(0, str(results.parent))
    import bench_longctx

    def size(name: str) -> str:  # the shape is in the file's tag (the CSV has no column for it): 8B unless named
        return "1b" if "_1b_" in name else "8b"

    errors = {}
    for shape, layers in sorted({(size(name), int(row["layers"])) for name, row in rows}):
        # bench_sp unties the head (its gradient is compared on its own), the 1B shape's too
        model = bench_longctx.build_model(dict(bench_longctx.MODELS[shape], layers=layers, tied=False), 1 << 20,
                                          torch.device("meta"), torch.bfloat16)
        mesh = init_device_mesh("cpu", (env.world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for name, row in rows:
            if (size(name), int(row["layers"])) == (shape, layers):
                plan = tiledmlp.plan_memory(model, int(row["T"]), sequence_parallel=env.world, norms=True,
                                            attention=True, offload="cpu", gpu_mib=1 << 20, host_mib=1 << 20)
                errors[f"{name}:{row['T']}"] = plan.gpu_peak_bytes / (float(row["peak_gib"]) * 2**30) - 1
    return {"rows": len(rows), "errors": errors}


SPLIT = 2  # the ranks one sequence is split over in the 2 x 2 cases: a "node" of 2, the data-parallel replicas across


def _split_in_two(env: Env, wrap: Callable[[nn.Module, Any], tuple[nn.Module, Callable[[], None]]],
                  tiled: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """Three steps with each sequence split over ``SPLIT`` ranks (DeepSpeed's Ulysses groups: consecutive ranks) and
    the ``world / SPLIT`` groups data-parallel, each group its share of a step's micro-batches. ``wrap(model, mpu)``
    returns the wrapped model and its step; the loss is ``tiledmlp.sequence_loss`` (the wrapper averages the
    gradients over every rank). The same training as :func:`reference`'s one process on the whole sequences."""
    replicas = env.world // SPLIT
    with ulysses(env, split=SPLIT) as mpu:
        group = mpu.get_sequence_parallel_group()
        part, replica = dist.get_rank(group), env.rank // SPLIT
        model = llama(env.device)
        wrapped, step = wrap(model, mpu)
        engine = hasattr(wrapped, "backward")  # a DeepSpeed engine
        if tiled:
            tiledmlp.enable_tiling(wrapped, tile_tokens=8, loss_scratch_mib=0.01)
        size = T // SPLIT
        cut = slice(part * size, (part + 1) * size)
        for micro in batches():
            for ids, labels in micro[replica::replicas]:
                shift = F.pad(labels, (0, 1), value=-100)[:, 1:]
                loss = tiledmlp.sequence_loss(wrapped, shift[:, cut].contiguous().to(env.device), group,
                                              input_ids=ids[:, cut].to(env.device),
                                              position_ids=torch.arange(T, device=env.device)[None, cut])
                if engine:  # it scales by its accumulation and steps at its boundary: called every micro-batch
                    wrapped.backward(loss)
                    step()
                else:
                    (loss / (MICRO // replicas)).backward()
            if not engine:
                step()
        strategies = tiledmlp.tiled_modules(wrapped)
        params = _gathered_params(model)
        if engine:
            wrapped.destroy()
        return params, strategies


def _gathered_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole parameters of ``model`` (ZeRO-3 partitions gathered, FSDP2 DTensors made full)."""
    from deepspeed.runtime.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu()
                .clone() for n, p in model.named_parameters()}


def _zero3(model: nn.Module, mpu: Any) -> tuple[nn.Module, Callable[[], None]]:
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
              "gradient_accumulation_steps": MICRO // (dist.get_world_size() // SPLIT),
              "zero_optimization": {"stage": 3}, "sequence_parallel_size": SPLIT}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                      config=config, mpu=mpu)
    return engine, engine.step


def _hsdp(model: nn.Module, mpu: Any) -> tuple[nn.Module, Callable[[], None]]:
    """FSDP2 over a (replicate, shard) mesh: shard inside a "node" (the split's ranks), replicate across."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh(next(model.parameters()).device.type, (world // SPLIT, SPLIT),
                            mesh_dim_names=("replicate", "shard"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        opt.step()
        opt.zero_grad()
    return model, step


def _split_in_two_case(env: Env, wrap: Callable[[nn.Module, Any], tuple[nn.Module, Callable[[], None]]]
                       ) -> dict[str, Any]:
    if env.world != 2 * SPLIT:  # at 2 ranks the split is over every rank: ulysses_zero3 and ulysses_no_engine's
        return {"world": env.world}
    runs = {name: _split_in_two(env, wrap, tiled) for name, tiled in (("untiled", False), ("tiled", True))}
    want = _params(reference(env.device))
    return {"untiled_rel": _rel(runs["untiled"][0], want), "tiled_rel": _rel(runs["tiled"][0], want),
            "tiled_vs_untiled": _rel(runs["tiled"][0], runs["untiled"][0]),
            "strategies": sorted(set(runs["tiled"][1].values()))}


@case
def ulysses_zero3_split_in_two(env: Env) -> dict[str, Any]:
    """ZeRO-3 over every rank, each sequence split by Ulysses over 2 of them: 2 "nodes" x 2 at 4 ranks (the
    data-parallel replicas across, each its own micro-batch)."""
    return _split_in_two_case(env, _zero3)


@case
def ulysses_hsdp_split_in_two(env: Env) -> dict[str, Any]:
    """HSDP (FSDP2 on a (replicate, shard) mesh) with each sequence split by Ulysses inside a "node" (the shard
    dimension): 2 x 2 at 4 ranks."""
    return _split_in_two_case(env, _hsdp)


def _zero(env: Env, stage: int) -> dict[str, Any]:
    with ulysses(env) as mpu:
        runs = {f"{'tiled' if tiled else 'untiled'}_{how}": train_with_engine(env, mpu, stage, how, tiled)
                for how in ("trainer", "sequence_loss") for tiled in (False, True)}
    return _metrics(env, runs)


@case
def ulysses_zero1(env: Env) -> dict[str, Any]:
    return _zero(env, 1)


@case
def ulysses_zero2(env: Env) -> dict[str, Any]:
    return _zero(env, 2)


@case
def ulysses_zero3(env: Env) -> dict[str, Any]:
    return _zero(env, 3)


def _trainer_run(env: Env, tiled: bool) -> tuple[float, dict[str, torch.Tensor], dict]:
    """Two Trainer steps with accelerate's ParallelismConfig(sp_backend="deepspeed", sp_size=world): its
    UlyssesSPDataLoaderAdapter splits each sequence and shifts the labels, its deepspeed_sp_compute_loss weighs the
    ranks' losses; ZeRO-3 (the stage whose reduction averages over the split), no clipping, SGD."""
    import deepspeed
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    deepspeed.init_distributed(dist_backend=dist.get_backend())
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    model = llama()
    if tiled:
        tiledmlp.enable_tiling(model, tile_tokens=8, loss_scratch_mib=0.01)
    data = [{"input_ids": ids, "labels": labels, "position_ids": torch.arange(T)}
            for micro in batches() for ids, labels in ((i[0], l[0]) for i, l in micro)]
    parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=env.world,
                                    sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))
    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": 3}, "gradient_clipping": "auto"}

    def params_of(trainer: Any) -> dict[str, torch.Tensor]:
        params = _gathered_params(trainer.model_wrapped.module)
        trainer.model_wrapped.destroy()
        return params

    def restore_sdpa() -> None:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa

    return trainer_run(model, data, parallelism, LR, params_of,
                       undo=(restore_sdpa, parallel_state_sp._release_sequence_parallel_groups),
                       use_cpu=env.device.type == "cpu", deepspeed=ds)


@case
def trainer_ulysses_zero3(env: Env) -> dict[str, Any]:
    """The Trainer with accelerate's Ulysses: tiled trains as untiled (loss and parameters)."""
    untiled_loss, untiled, _ = _trainer_run(env, tiled=False)
    tiled_loss, params, strategies = _trainer_run(env, tiled=True)
    return {"losses": [untiled_loss, tiled_loss], "tiled_vs_untiled": _rel(params, untiled),
            "strategies": sorted(set(strategies.values())), "moved": _rel(untiled, _params(llama()))}


@case
def cp_mesh_is_named(env: Env) -> dict[str, Any]:
    """FSDP2 over a ``dp_shard x cp`` mesh flattened (torchtitan's and accelerate's context-parallel layout): grouped
    KV heads in SDPA attention refused (torch's ring has no grouped-query path), naming repeat_kv_heads, model
    untouched; with the heads repeated, the strategy names the split, and unshifted labels are refused; heads
    grouped again after tiling: refused at the call. (torch's ring attention itself needs a GPU.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(env.device.type, (env.world // 2, 2), mesh_dim_names=("dp_shard", "cp"))
    flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    model = llama(env.device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)
    out: dict[str, Any] = {"grouped_refused": _refusal(lambda: tiledmlp.enable_tiling(model)),
                           "untouched": tiledmlp.tiled_modules(model) == {}}
    repeated = tiledmlp.repeat_kv_heads(model)
    tiledmlp.enable_tiling(model)
    out["strategies"] = sorted(set(tiledmlp.tiled_modules(model).values()))
    ids = torch.randint(VOCAB, (1, T // 2), device=env.device)
    out["refused"] = _refusal(lambda: model(input_ids=ids, labels=ids))
    repeated.remove()
    out["grouped_call_refused"] = _refusal(lambda: model(input_ids=ids, labels=ids, shift_labels=ids))
    return out


def _refusal(call: Any) -> str:
    """The ValueError's message ``call`` raised ('' if it raised none)."""
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return ""


@case
def sequence_loss_bad_input(env: Env) -> dict[str, Any]:
    """What sequence_loss refuses, each with the fix named."""
    model = llama(env.device)
    ids = torch.randint(VOCAB, (1, 8), device=env.device)
    return {"labels": _refusal(lambda: tiledmlp.sequence_loss(model, ids, input_ids=ids, labels=ids)),
            "scale": _refusal(lambda: tiledmlp.sequence_loss(model, ids, input_ids=ids, grads_averaged_over=0))}


@case
def ulysses_unshifted_labels_refused(env: Env) -> dict[str, Any]:
    """Labels (not shift_labels) given to a rank's part: refused, naming the fix, before anything is computed."""
    with ulysses(env):
        model = tiledmlp.enable_tiling(llama(env.device))
        ids = torch.randint(VOCAB, (1, T), device=env.device)
        try:
            model(input_ids=_part(env, ids), position_ids=_part(env, torch.arange(T, device=env.device)[None]),
                  labels=_part(env, ids))
        except ValueError as exc:
            return {"refused": "shift_labels" in str(exc) and "Ulysses" in str(exc), "message": str(exc)[:200]}
    return {"refused": False}
