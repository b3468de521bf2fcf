"""What each part of ``enable_tiling`` takes, made from its :class:`~tiledmlp.plan.options.TilingOptions` in one
place (:func:`bundles`): the shard policy (``tiledmlp.core.sharding``), the tiled loss's options
(``tiledmlp.loss.heads``), the plan of each module (``state.PlanOptions``) and the step's memory terms
(``tiledmlp.plan.memory.StepOptions``)."""

from __future__ import annotations

from typing import NamedTuple, Optional

from torch import nn

from ..core.sharding import ShardPolicy
from ..loss.heads import LossOptions
from ..plan.memory import StepOptions
from ..plan.optimizer import optimizer_memory
from ..plan.options import TilingOptions
from .state import PlanOptions

__all__ = ["Bundles", "bundles"]


class Bundles(NamedTuple):
    policy: ShardPolicy
    loss: Optional[LossOptions]  # None: the loss is not tiled (loss=False)
    plan: PlanOptions
    step: StepOptions


def bundles(model: nn.Module, options: TilingOptions, chosen_because: str = "") -> Bundles:
    """``options`` as the parts of ``enable_tiling`` take them; the optimizer's bytes counted on ``model`` as it is
    now (an object not yet stepped in backward where it is placed there); ``chosen_because``: why ``seq_len`` chose
    them ("" without)."""
    policy = options.shard_policy()
    loss = None if options.loss is False else LossOptions(options.loss_scratch_mib, options.loss_mode,
                                                          options.loss_grad_accum_dtype)
    plan = PlanOptions(options.strategy, policy, options.mlp_types, options.include_moe, options.form,
                       options.grad_accum_dtype, options.norms, options.projections)
    step = StepOptions(loss=loss is not None, norms=options.norms, attention=options.attention,
                       offload=options.offload, scratch_mib=policy.scratch_mib, projections=options.projections,
                       optimizer=optimizer_memory(model, options.optimizer, options.optimizer_placement),
                       chosen_because=chosen_because, gpu_mib=options.gpu_mib, host_mib=options.host_mib,
                       **({"loss_scratch_bytes": int(loss.scratch_mib * 2**20)} if loss is not None and loss.scratch_mib
                          else {}))
    return Bundles(policy, loss, plan, step)
