"""One sequence split across ranks: DeepSpeed's Ulysses and torch's context parallelism, seen from tiling.

[Note: what a split sequence changes for tiling]
Under sequence parallelism (Ulysses: an all-to-all around the model's attention core; torch's ring
``context_parallel``: the attention core exchanges keys and values) every other op of a decoder layer — the
MLP, the norms, the LM head and its loss — is per token and sees this rank's part of the sequence. Tiling
therefore needs no collective of its own: its shards cut the local tokens, its gradients reach the
data-parallel wrapper once per backward, and what a rank issues (ZeRO-3's one gather per tiled call, FSDP2's
one unshard) never depends on how many shards its own part makes — ranks of one sequence may hold different
numbers of valid labels, and a load-balanced ring hands them different chunks. What sequence parallelism does
change is the loss: labels must be shifted *before* the split (a rank cannot shift across its boundary), and
the loss of the whole sequence is the sum of every rank's token losses over the whole sequence's valid labels
— not the mean of per-rank means (a rank may hold none: prompt masking).

* :func:`split_of` says whether (and how) a model's sequence is split: Ulysses when DeepSpeed registered its
  attention with transformers for the model's attention implementation and initialized its sequence-parallel
  group; torch CP when the model's parameters live on a device mesh whose root has a ``cp`` dimension
  (torchtitan's and accelerate's ``dp_shard × cp`` meshes). ``describe()`` and ``tiled_modules()`` name it
  after the strategy (``ddp+sp``, ``deepspeed+sp``, ``fsdp2+cp``).
* :func:`sequence_loss` is the loss of the whole sequence from this rank's part, for custom training loops;
  the Hugging Face ``Trainer`` (accelerate's ``ParallelismConfig``) computes it itself from the model's loss,
  which tiledmlp computes per rank from pre-shifted ``shift_labels`` — and refuses unshifted labels under a
  split, which would silently drop a label at every rank boundary.

Communication: :func:`sequence_loss` all-reduces two scalars over the group (the valid-label count and, for the
value it returns, the loss sum); nothing else here communicates.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SequenceSplit", "split_of", "sequence_loss", "ulysses_module"]


@dataclass(frozen=True)
class SequenceSplit:
    """How a sequence is split: ``kind`` ``"sp"`` (DeepSpeed Ulysses) or ``"cp"`` (torch context parallel), over
    ``size`` ranks (``group``: their process group, where known)."""

    kind: str
    size: int
    group: Any = None


def _ulysses_group() -> Any:
    """DeepSpeed's sequence-parallel group, when its Ulysses set one up in this process."""
    state = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    return getattr(state, "_SEQUENCE_PARALLEL_GROUP", None)


def _ulysses_wrapper(model: nn.Module) -> Any:
    """The model's attention implementation when it is DeepSpeed's Ulysses wrapper (``register_with_transformers``
    puts it in place of the core implementation it wraps), else None."""
    functions = getattr(sys.modules.get("transformers.modeling_utils"), "ALL_ATTENTION_FUNCTIONS", None)
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if functions is None or not isinstance(implementation, str) or implementation not in functions:
        return None
    function = functions[implementation]
    return function if "uattn_wrapper" in getattr(function, "__qualname__", "") else None


def _ulysses_attention(model: nn.Module) -> bool:
    return _ulysses_wrapper(model) is not None


def ulysses_module(model: nn.Module) -> Optional[nn.Module]:
    """DeepSpeed's ``UlyssesSPAttentionHF`` instance that ``model``'s attention calls (the module its
    ``register_with_transformers`` wrapper closes over), when ``model``'s sequence is split by Ulysses; else None."""
    split = split_of(model)
    if split is None or split.kind != "sp":
        return None
    for module in model.modules():
        wrapper = _ulysses_wrapper(module) if hasattr(module, "config") else None
        if wrapper is not None and "uattn" in wrapper.__code__.co_freevars:
            return wrapper.__closure__[wrapper.__code__.co_freevars.index("uattn")].cell_contents
    return None


def _cp_size(model: nn.Module) -> int:
    """The ``cp`` dimension's size of the device mesh the model's parameters live on (its root mesh), or 1."""
    from .detect import is_dtensor

    if not dist.is_available() or not dist.is_initialized():
        return 1
    mesh = next((p.device_mesh for p in model.parameters() if is_dtensor(p)), None)
    return 1 if mesh is None else _cp_of(mesh)


def _cp_of(mesh: Any) -> int:
    """The ``cp`` size of ``mesh``'s root (a flattened ``dp_shard_cp`` mesh's parent), or 1."""
    root = mesh._get_root_mesh()
    names = getattr(root, "mesh_dim_names", None) or ()
    return root["cp"].size() if "cp" in names else 1


def split_of(model: nn.Module) -> Optional[SequenceSplit]:
    """How ``model``'s sequence is split across ranks (see [Note: what a split sequence changes for tiling]), or
    None."""
    group = _ulysses_group()
    if group is not None and any(_ulysses_attention(m) for m in model.modules() if hasattr(m, "config")):
        size = dist.get_world_size(group)
        if size > 1:
            return SequenceSplit("sp", size, group)
    cp = _cp_size(model)
    return SequenceSplit("cp", cp) if cp > 1 else None


def _summed_over_the_split(model: Optional[nn.Module]) -> bool:
    """Whether ``model``'s wrapper sums (rather than averages) the ranks' gradients over the sequence-parallel
    group: DeepSpeed's ZeRO-1/2 engines set up with Ulysses do (their reduction averages over the data-parallel
    ranks only: measured on gloo, ``tests/distributed/cases_sp.py``); its ZeRO-3 engine, DDP and FSDP2 over a mesh
    holding the split average over it."""
    stage = getattr(model, "zero_optimization_stage", None)
    return callable(stage) and stage() < 3 and getattr(model, "sequence_parallel_size", 1) > 1


def sequence_loss(model: nn.Module, shift_labels: torch.Tensor, group: Any = None, *,
                  grads_averaged_over: Optional[int] = None, ignore_index: int = -100, **inputs: Any) -> torch.Tensor:
    """The loss of a whole sequence split across the ranks of ``group``, from this rank's part: one call of
    ``model`` (a Hugging Face causal LM, tiled or not, through whatever wrapper trains it: DDP, FSDP2, a DeepSpeed
    engine — call the wrapper, not a submodule: ZeRO-3 trains wrong otherwise).

    Args:
        model: the (wrapped) model; called as ``model(**inputs, labels=shift_labels, shift_labels=shift_labels,
            num_items_in_batch=<the whole sequence's valid labels>)``, so its loss is this rank's sum of token losses
            over the whole sequence's count (the tiled loss when tiling is on).
        shift_labels: this rank's labels, **shifted before the split** (``labels[..., 1:]`` of the whole sequence,
            padded with ``ignore_index``, then cut like the inputs: what DeepSpeed's ``UlyssesSPDataLoaderAdapter``
            and the ``Trainer`` hand each rank).
        group: the ranks holding the sequence's parts (default: every rank).
        grads_averaged_over: how many ranks of ``group`` the wrapper averages gradients over (default: the group's
            size — DDP, FSDP2 or ZeRO-3 over a mesh that includes the split, as DeepSpeed's Ulysses, accelerate and
            torchtitan set them up; 1 when ``model`` is a DeepSpeed ZeRO-1/2 engine, whose reduction sums over the
            sequence-parallel ranks: measured, ``tests/distributed/cases_sp.py``). Pass 1 where gradients are summed,
            or not reduced, across the group.
        inputs: this rank's part of the other model inputs (``input_ids``, global ``position_ids``, ...).

    Returns the same value on every rank: the sum of every rank's token losses over the number of valid labels of
    the whole sequence (0 where it has none, as the ``Trainer``'s aggregation). Its gradient on this rank is its own
    tokens' share times ``grads_averaged_over``, so that once the wrapper averages the ranks' gradients they are the
    whole sequence's: not scaled by the split degree (DeepSpeed #5248, transformers #46775), and right when the ranks
    hold different numbers of valid labels, none included (Megatron-LM #673). Memory and FLOP: the model's. Extra
    communication: two all-reduces of one scalar over ``group``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("sequence_loss needs torch.distributed initialized: it sums over the ranks that hold the "
                         "sequence's parts (for a sequence on one rank, call the model with labels)")
    if "labels" in inputs or "num_items_in_batch" in inputs:
        raise ValueError("sequence_loss passes labels (its shift_labels) and num_items_in_batch to the model itself")
    size = dist.get_world_size(group)
    scale = grads_averaged_over if grads_averaged_over is not None else 1 if _summed_over_the_split(model) else size
    if isinstance(scale, bool) or not isinstance(scale, int) or not 1 <= scale <= size:
        raise ValueError(f"grads_averaged_over must be an int from 1 to the group's size {size}, got {scale!r}")
    valid = (shift_labels != ignore_index).sum().float()
    dist.all_reduce(valid, group=group)
    local = model(**inputs, labels=shift_labels, shift_labels=shift_labels, ignore_index=ignore_index,
                  num_items_in_batch=valid.clamp_min(1)).loss
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    # The value: the whole sequence's loss; the gradient: this rank's share, scaled for the wrapper's average.
    share = local * scale
    return share + (total - share).detach()
