"""Forms: how one MLP is computed from a token shard and the parameter tensors handed to it.

Two forms implement :class:`tiledmlp.core.form.Form` for MLPs (the loss has its own,
``tiledmlp.loss``):

* :class:`ModuleForm` (generic) runs the module's own forward with its parameters swapped for the
  tensors the tiled function passes (detached leaves in backward), so any per-token module works — a
  PEFT-LoRA MLP, a MoE block, a custom module. Backward recomputes the whole forward per shard and asks
  autograd for the shard's gradients.
* :class:`tiledmlp.forms.mlp.MLPForm` (fast) computes a gated or plain MLP straight from its
  weights and recomputes only the pre-activations in backward (see that module).

The generic form's scratch is the module's own and cannot be sized, but for the modules it is given because
their float32 copies of the input dominate (normalization layers, LoRA projections): :func:`norm_scratch_per_token`.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from ..core.accumulate import GradAccumulator

__all__ = ["Slot", "ModuleForm", "dedupe", "is_plain_linear", "is_quantized", "parametrized", "read_slots", "swapped",
           "norm_scratch_per_token", "NORM_FLOAT32_COPIES"]

#: float32 copies of its input that a normalization layer's shard may hold at once: Hugging Face's RMSNorm
#: keeps up to five in backward (measured, ``tiledmlp.recognize.norms``), plus the input's and output's shard
NORM_FLOAT32_COPIES = 8


def norm_scratch_per_token(hidden: int) -> int:
    """Bytes of a normalization layer's (or a LoRA projection's) generic-form scratch per token:
    ``NORM_FLOAT32_COPIES`` float32 rows of its ``hidden`` width, what the shard policy cuts its calls by."""
    return NORM_FLOAT32_COPIES * 4 * hidden


def is_quantized(t: Any) -> bool:
    """A bitsandbytes quantized parameter (4-bit ``Params4bit``, 8-bit ``Int8Params``): never detached, swapped for
    a plain tensor or differentiated by tiling (``tiledmlp.forms.quant``)."""
    return isinstance(t, torch.Tensor) and type(t).__module__.startswith("bitsandbytes")


@dataclass(frozen=True)
class Slot:
    """Where a parameter lives: ``getattr(owner, name)``.

    Reading through the slot at call time returns whatever the wrapper put there — the parameter
    itself, an FSDP2 unsharded parameter, or an FSDP1 flat-parameter view.
    """

    owner: nn.Module
    name: str

    def get(self) -> torch.Tensor:
        # What ``getattr`` returns, without the module's attribute machinery: DeepSpeed ZeRO-3 replaces
        # ``_parameters`` with a mapping whose item access all-gathers a partitioned parameter (one
        # collective per parameter) and registers it with whichever module is in forward.
        owner, name = self.owner, self.name
        if name in owner.__dict__:
            return owner.__dict__[name]
        if name in owner._parameters:
            return dict.__getitem__(owner._parameters, name)
        return getattr(owner, name)


def read_slots(slots: Sequence[Slot]) -> list[torch.Tensor]:
    """The tensors ``slots`` hold now, in one step (a caller in another package enters this one once, not once per
    slot)."""
    return [slot.get() for slot in slots]


@contextlib.contextmanager
def swapped(slots: Sequence[Slot], tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Temporarily make ``slot.owner.<name>`` return ``tensor`` (restored on exit, also on error)."""
    undo: list[tuple[dict, str, Any]] = []
    try:
        for slot, tensor in zip(slots, tensors):
            owner = slot.owner
            table = owner._parameters if slot.name in owner._parameters else owner.__dict__
            undo.append((table, slot.name, table[slot.name]))
            table[slot.name] = tensor
        yield
    finally:
        for table, name, old in reversed(undo):
            table[name] = old


def is_plain_linear(m: Any) -> bool:
    """An ``nn.Linear`` computing ``F.linear(x, weight, bias)`` (not a subclass with its own forward)."""
    return type(m) is nn.Linear or (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward)


def parametrized(m: nn.Module) -> str:
    """What ``m``'s parametrizations (``torch.nn.utils.parametrize``: ``parametrizations.weight_norm``,
    ``spectral_norm``, ``orthogonal``, ``register_parametrization``) compute, in words ("" for none): its ``weight`` is
    then no parameter but computed at each read from the parametrization's originals, which a fast form or the tiled
    loss, computing from the parameters read through their slots, would not follow. The module's own forward does:
    the generic form's."""
    plists = m._modules.get("parametrizations")  # where register_parametrization puts them (is_parametrized's test)
    if not isinstance(plists, nn.ModuleDict):
        return ""
    return "parametrized (" + "; ".join(f"{name} by {', '.join(type(p).__name__ for p in plist)}"
                                        for name, plist in plists.items()) + ")"


def _as_leaves(params: Sequence[torch.Tensor], needs: Sequence[bool]) -> list[torch.Tensor]:
    """Detached copies (sharing storage) that autograd can differentiate without touching the originals. A
    quantized weight stays itself: it gets no gradient, and its module needs its quantization state (a bitsandbytes
    4-bit layer cannot compute with a plain tensor of its packed bytes)."""
    return [p if is_quantized(p) else p.detach().requires_grad_(need) for p, need in zip(params, needs)]


def dedupe(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Unique tensors (by identity) and, per input position, the index of its unique tensor."""
    unique: list[torch.Tensor] = []
    seen: dict[int, int] = {}
    index = []
    for t in tensors:
        key = id(t)
        if key not in seen:
            seen[key] = len(unique)
            unique.append(t)
        index.append(seen[key])
    return unique, index


class ModuleForm:
    """Generic form: ``forward(x)`` of the module, with parameters swapped in through ``slots``.

    ``forward`` is the module's original (unpatched) forward, or ``fn(module, x)`` for
    :func:`tiledmlp.apply_tiled_mlp`. ``slot_index[k]`` says which of the tensors handed to the tiled
    function serves slot ``k`` (several slots may share one tensor, e.g. tied weights).

    A shard is given to ``forward`` with the input's rank (a ``[B, T, H]`` input becomes ``[1, rows,
    H]`` shards) and as a copy, because some blocks scale their input in place (Mixtral's router jitter).
    Each output must be token-leading: shaped like the shard's leading dims, or ``[rows, ...]``.
    """

    stochastic = True
    grads_in_forward = False
    float32_sums = ()

    def __init__(self, forward: Callable[..., Any], slots: Sequence[Slot], slot_index: Sequence[int],
                 input_ndim: int) -> None:
        self.forward = forward
        self.slots = tuple(slots)
        self.slot_index = tuple(slot_index)
        self.input_ndim = input_ndim
        # Filled by the first shard: which outputs carry the input's leading dims, and whether the
        # module returned a tuple.
        self.leading_outputs: tuple[bool, ...] = ()
        self.returned_tuple = False

    def _call(self, x: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        rows = x.shape[0]
        lead = (1,) * (self.input_ndim - 2) + (rows,)
        out = self.forward(x.clone().view(*lead, x.shape[-1]))
        self.returned_tuple = isinstance(out, (tuple, list))
        outs = tuple(out) if self.returned_tuple else (out,)
        flat: list[Optional[torch.Tensor]] = []
        leading: list[bool] = []
        for k, o in enumerate(outs):
            if o is None:
                flat.append(None)
                leading.append(False)
            elif not isinstance(o, torch.Tensor):
                raise TypeError(
                    f"a tiled module must return tensors (or a tuple of tensors/None); output {k} is "
                    f"{type(o).__name__}. Tile only per-token MLP blocks."
                )
            elif tuple(o.shape[: len(lead)]) == lead:
                flat.append(o.reshape(rows, *o.shape[len(lead):]))
                leading.append(True)
            elif o.dim() >= 1 and o.shape[0] == rows:
                flat.append(o)
                leading.append(False)
            else:
                raise ValueError(
                    f"output {k} of the tiled module has shape {tuple(o.shape)} for a shard of {rows} "
                    "tokens: it does not scale with the tokens, so the module is not per-token and "
                    "cannot be tiled. Exclude it from tiling."
                )
        self.leading_outputs = tuple(leading)
        return tuple(flat)

    def _swapped(self, tensors: Sequence[torch.Tensor]):
        return swapped(self.slots, [tensors[i] for i in self.slot_index])

    def forward_shard(self, x: torch.Tensor, params: Sequence[torch.Tensor],
                      out: Optional[Sequence[Optional[torch.Tensor]]] = None,
                      side: Sequence[torch.Tensor] = ()) -> tuple[Optional[torch.Tensor], ...]:
        # ``out`` is ignored: the module allocates its own outputs. A module gets no side inputs.
        with self._swapped(params):
            return self._call(x)

    def backward_shard(self, x, grad_outputs, params, dx_out, grads: GradAccumulator, side=()) -> None:
        leaves = _as_leaves(params, grads.needs)
        x_leaf = x.detach().requires_grad_(dx_out is not None)
        with torch.enable_grad(), self._swapped(leaves):
            outs = self._call(x_leaf)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if o is not None and g is not None and o.requires_grad]
        wanted = [i for i, need in enumerate(grads.needs) if need]
        inputs = ([x_leaf] if dx_out is not None else []) + [leaves[i] for i in wanted]
        if not pairs or not inputs:
            if dx_out is not None:
                dx_out.zero_()
            return
        # Each parameter's shard gradient goes into its accumulator the moment autograd has it, and is
        # released: only the gradients in flight are alive, not every parameter's at once (for an MoE
        # block that is every expert's full gradient: as much again as the accumulators).
        handles = [leaves[i].register_post_accumulate_grad_hook(functools.partial(_drain_into, grads, i))
                   for i in wanted]
        try:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=inputs)
        finally:
            for handle in handles:
                handle.remove()
        if dx_out is not None:
            dx_out.zero_() if x_leaf.grad is None else dx_out.copy_(x_leaf.grad)


def _drain_into(grads: GradAccumulator, i: int, leaf: torch.Tensor) -> None:
    grads.add(i, leaf.grad)
    leaf.grad = None
