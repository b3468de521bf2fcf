"""The columns of the matrix (``matrix.py``): how a case's model is wrapped — :class:`DDP`, :class:`FSDP1`,
:class:`FSDP2`, :class:`TP` (DeepSpeed's engine: ``zero.py``) — the strategy its tiled modules report, and the
torchrun launches that run it (:class:`Launch`); and what a case trains (:class:`Model`: a build, its batches, its
loss).

A wrapper is a value built when the matrix is declared; it touches the process group only in :meth:`Wrapper.wrap` on a
rank (a mesh is made there). Collectives are counted by wrapping ``torch.distributed``'s functions (FSDP1, FSDP2;
``all_gather_single`` / ``reduce_scatter_single`` in torch 2.13, ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
in older releases: all are wrapped), DDP's through a communication hook with buckets capped at 2 KB (every parameter a
bucket of its own: a gradient that reached the reducer twice, or never, changes the count), DTensor's through
``CommDebugMode`` (``dtensor_*`` keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional

import torch
from torch import nn

from .common import (Batch, Env, Recipe, bf16_noise_metrics, compare, ddp_sync, float_batches, fsdp2_sync,
                     hf_batches, token_batches, train, untiled_vs_tiled)
from .models import HF_VOCAB
from .runs import compile_blocks, with_graph_counts
from .titan import apply_fsdp, apply_tp, world_meshes

if TYPE_CHECKING:
    from .matrix import Case

#: a wrapper's gradient accumulation: ``sync(model, is_last_micro_batch)``'s context
Sync = Callable[[nn.Module, bool], ContextManager]


@dataclass(frozen=True)
class Launch:
    """One torchrun launch: the matrix's cases of one kind of world, run one after the other by ``worker.py``."""

    name: str
    nproc: Optional[int] = None  # None: one process per GPU, else 2 (harness.default_nproc)
    gpus: int = 0  # GPUs it runs on when the machine has them; fewer: CPU processes (gloo)
    label: str = ""  # in the test ids of a case that several launches run
    needs: str = ""  # a module without which it is skipped (an optional test extra)

    def device(self) -> Optional[str]:
        """``"cpu"`` where the machine has fewer GPUs than the launch asks for, else its default."""
        return "cpu" if self.gpus and torch.cuda.device_count() < self.gpus else None


DDP_LAUNCH, FSDP1_LAUNCH, FSDP2_LAUNCH = Launch("ddp"), Launch("fsdp1"), Launch("fsdp2")
TP_LAUNCH = Launch("tp", nproc=2, gpus=2, label="2proc")
WORLD4 = Launch("world4", nproc=4, gpus=4, label="4proc")  # the cases that need a world of 4 (FSDP2, TP)
ZERO_1PROC = Launch("zero-1proc", nproc=1, label="1proc", needs="deepspeed")
ZERO_2PROC = Launch("zero-2proc", nproc=2, label="2proc", needs="deepspeed")
LAUNCHES = (DDP_LAUNCH, FSDP1_LAUNCH, FSDP2_LAUNCH, TP_LAUNCH, WORLD4, ZERO_1PROC, ZERO_2PROC)


def _tokens(env: Env, micro: int) -> list[list[Batch]]:
    return token_batches(env, micro=micro)


def _hf_tokens(env: Env, micro: int) -> list[list[Batch]]:
    return hf_batches(env, HF_VOCAB, micro=micro)


def _floats(env: Env, micro: int) -> list[list[Batch]]:
    assert micro == 1, "the float batches have one micro-batch per step"
    return float_batches(env)


def _floats_experts_idle_on_rank0(env: Env, micro: int) -> list[list[Batch]]:
    """On rank 0 every token gets a first feature <= 0: :class:`models.ToyMoE`'s experts 1 and 2 see no token there."""
    batches = _floats(env, micro)
    if env.rank == 0:
        for (b,) in batches:
            b["x"][..., 0] = -b["x"][..., 0].abs()
    return batches


def _called(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch)


def hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(**batch).loss


@dataclass(frozen=True)
class Model:
    """What a case trains: ``build()`` (from seed 0), its batches per step and micro-batch, and its loss."""

    build: Callable[[], nn.Module]
    batches: Callable[[Env, int], list[list[Batch]]] = _tokens
    loss_of: Callable[[nn.Module, Batch], torch.Tensor] = _called

    @staticmethod
    def hf(build: Callable[[], nn.Module]) -> Model:
        """A Hugging Face causal LM: input ids and labels, its own loss."""
        return Model(build, _hf_tokens, hf_loss)

    @staticmethod
    def floats(build: Callable[[], nn.Module], loss_of: Callable[[nn.Module, Batch], torch.Tensor] = _called,
               experts_idle_on_rank0: bool = False) -> Model:
        """A model of hidden states (``x``, no gradient) and regression targets."""
        return Model(build, _floats_experts_idle_on_rank0 if experts_idle_on_rank0 else _floats, loss_of)


class Wrapper:
    """A column of the matrix. Subclasses say how they wrap (:meth:`wrap`), the strategy a tiled module reports under
    them, how they accumulate gradients (``sync``) and which launches run their cases."""

    strategy: Optional[str] = None
    launches: tuple[Launch, ...] = ()
    sync: Optional[Sync] = None

    def wrap(self, env: Env, **options: Any) -> Callable[[nn.Module], nn.Module]:
        raise NotImplementedError

    def recipe(self, case: Case, env: Env, **options: Any) -> Recipe:
        """How ``case`` trains on this rank; ``options``: the wrapper's, added (FSDP2's ``mp_policy``)."""
        return Recipe(build=case.model.build, batches=case.model.batches(env, case.micro),
                      wrap=self.wrap(env, **options), tile=case.tile, tile_before_wrap=case.tile_before_wrap,
                      loss_of=case.model.loss_of, optimizer=case.optimizer,
                      sync=self.sync if case.micro > 1 else None)

    def run(self, case: Case, env: Env) -> dict[str, Any]:
        """``case`` trained untiled and tiled under this wrapper and compared (``common.untiled_vs_tiled``): each
        decoder block compiled first (``case.compiled``: its graphs counted), both runs in bf16 against an untiled
        float32 run (``case.bf16``), or the untiled run under other options (``case.reference``)."""
        if case.bf16:
            return bf16_noise_metrics(env, *self.bf16_recipes(case, env))
        recipe = self.recipe(case, env)
        if case.reference is not None:
            return compare(train(case.reference.recipe(case, env), env, tiled=False), train(recipe, env, tiled=True))
        if not case.compiled:
            return untiled_vs_tiled(recipe, env)
        counters: list = []
        wrap = recipe.wrap
        recipe.wrap = lambda model: wrap(compile_blocks(model, counters))
        return with_graph_counts(untiled_vs_tiled(recipe, env), counters)

    def bf16_recipes(self, case: Case, env: Env) -> tuple[Recipe, Recipe]:
        """``(float32, bf16)`` recipes of ``case``: FSDP2's ``MixedPrecisionPolicy`` (bf16 parameters, float32
        gradient reduction) by default."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return self.recipe(case, env), self.recipe(case, env, mp_policy=policy)


#: DDP's buckets capped so that every parameter is a bucket of its own
ONE_BUCKET_PER_PARAM_MB = 2 / 1024


@dataclass(frozen=True)
class DDP(Wrapper):
    """``DistributedDataParallel`` with ``options``; buckets of one parameter unless ``default_buckets`` (Dynamo's
    DDPOptimizer refuses a first bucket larger than the others)."""

    options: dict = field(default_factory=dict)
    default_buckets: bool = False
    strategy = "ddp"
    launches = (DDP_LAUNCH,)
    sync = staticmethod(ddp_sync)

    def wrap(self, env: Env, **options: Any) -> Callable[[nn.Module], nn.Module]:
        from torch.nn.parallel import DistributedDataParallel

        buckets = {} if self.default_buckets else {"bucket_cap_mb": ONE_BUCKET_PER_PARAM_MB}
        return lambda model: DistributedDataParallel(model, device_ids=[env.local_rank] if env.on_gpu else None,
                                                     **buckets, **self.options, **options)


def ddp(default_buckets: bool = False, **options: Any) -> DDP:
    return DDP(options, default_buckets)


@dataclass(frozen=True)
class FSDP1(Wrapper):
    """``FullyShardedDataParallel`` at the root, and every ``unit`` module an instance of its own (None: the root
    only); flat parameters (the MLP's weights views of one) or ``use_orig_params``. FSDP1 needs ``device_id``: with
    ``cpu`` it runs on gloo (torch >= 2.13 here), with ``cuda:<rank>`` on NCCL."""

    unit: Optional[type] = None
    orig_params: bool = False
    strategy = "fsdp1"
    launches = (FSDP1_LAUNCH,)
    sync = staticmethod(ddp_sync)

    def wrap(self, env: Env, **options: Any) -> Callable[[nn.Module], nn.Module]:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({self.unit}) if self.unit is not None else None
        return lambda model: FullyShardedDataParallel(model, device_id=env.device, auto_wrap_policy=policy,
                                                      use_orig_params=self.orig_params, **options)


@dataclass(frozen=True)
class FSDP2(Wrapper):
    """``fully_shard`` every module of each type in ``units`` (in that order), ``lm_head`` with ``head_unit``, then the
    root: on a 1-D mesh, or with ``replicas`` > 1 on a ``(replicate, shard)`` mesh (HSDP: each parameter sharded
    within a group of ``world / replicas`` ranks, as inside a node, and replicated across the groups, as across
    nodes). ``checkpointed_units``: a non-reentrant ``checkpoint_wrapper`` around each decoder layer's unit, which
    calls the unit's ``__call__``, its FSDP2 hooks included, in forward and again in the recompute (what
    transformers before 5.24 does with its own checkpointing). ``cpu_offload``: ``CPUOffloadPolicy``."""

    units: tuple[type, ...] = ()
    options: dict = field(default_factory=dict)
    head_unit: bool = False
    replicas: int = 1
    checkpointed_units: bool = False
    cpu_offload: bool = False
    launches: tuple[Launch, ...] = (FSDP2_LAUNCH,)
    strategy = "fsdp2"
    sync = staticmethod(fsdp2_sync)

    def wrap(self, env: Env, **options: Any) -> Callable[[nn.Module], nn.Module]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        shape = (env.world,) if self.replicas == 1 else (self.replicas, env.world // self.replicas)
        names = {} if self.replicas == 1 else {"mesh_dim_names": ("replicate", "shard")}
        mesh = init_device_mesh(env.device.type, shape, **names)
        options = {**self.options, **options}
        if self.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")

        def wrap(model: nn.Module) -> nn.Module:
            if self.checkpointed_units:
                from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                                         checkpoint_wrapper)
                layers = model.model.layers
                for i, layer in enumerate(layers):
                    fully_shard(layer, mesh=mesh, **options)
                    layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            for unit in self.units:
                for m in [m for m in model.modules() if isinstance(m, unit)]:
                    fully_shard(m, mesh=mesh, **options)
            if self.head_unit:
                fully_shard(model.lm_head, mesh=mesh, **options)
            fully_shard(model, mesh=mesh, **options)
            return model

        return wrap


def fsdp2(*units: type, **options: Any) -> FSDP2:
    """:class:`FSDP2` of ``units``; ``options``: ``fully_shard``'s, or the wrapper's own fields."""
    own = {k: options.pop(k) for k in ("head_unit", "replicas", "checkpointed_units", "cpu_offload", "launches")
           if k in options}
    return FSDP2(units, options, **own)


@dataclass(frozen=True)
class TP(Wrapper):
    """torchtitan's tensor-parallel plan (``titan.py``) on a ``tp``-wide mesh (None: the world), with or without
    sequence parallelism, and FSDP2 per block and root over the rest of the world (none when ``tp`` is the world
    size). Its model is ``titan.Transformer``'s; its batches are the same on every rank of a TP group (TP needs them),
    different across data-parallel ranks, in lengths divisible by the TP degree (sequence parallelism shards them)
    that differ from step to step and between data-parallel ranks (so do the shard counts)."""

    tp: Optional[int] = None
    sequence_parallel: bool = True
    launches: tuple[Launch, ...] = (TP_LAUNCH,)

    @property
    def strategy(self) -> str:
        return "tp" if self.tp is None else "fsdp2+tp"

    def meshes(self, env: Env) -> tuple[Optional[Any], Any]:
        return world_meshes(env.device.type, env.world, self.tp or env.world)

    def recipe(self, case: Case, env: Env, dtype: torch.dtype = torch.float32, **options: Any) -> Recipe:
        dp_mesh, tp_mesh = self.meshes(env)

        def wrap(model: nn.Module) -> nn.Module:
            apply_tp(model, tp_mesh, self.sequence_parallel)
            return model if dp_mesh is None else apply_fsdp(model, dp_mesh, **options)

        dp_rank = 0 if dp_mesh is None else dp_mesh.get_local_rank()
        return Recipe(build=lambda: case.model.build().to(dtype), batches=tp_batches(env, dp_rank), wrap=wrap,
                      tile=case.tile, tile_before_wrap=case.tile_before_wrap, count_dtensor=True, foreach=False)

    def bf16_recipes(self, case: Case, env: Env) -> tuple[Recipe, Recipe]:
        """bf16 parameters under TP alone; FSDP2's mixed precision (float32 reduction) over TP."""
        if self.tp is not None:
            return super().bf16_recipes(case, env)
        return self.recipe(case, env), self.recipe(case, env, dtype=torch.bfloat16)


def tp_batches(env: Env, dp_rank: int, steps: int = 3, batch: int = 2) -> list[list[Batch]]:
    """:class:`TP`'s batches (its docstring)."""
    from .titan import VOCAB

    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 * (dp_rank + 1) + s)
        t = (40, 56, 48, 64)[(s + dp_rank) % 4]
        ids = torch.randint(VOCAB, (batch, t + 1), generator=g)
        out.append([{"ids": ids[:, :-1].to(env.device), "labels": ids[:, 1:].to(env.device)}])
    return out
