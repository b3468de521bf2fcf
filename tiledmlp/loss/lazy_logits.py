"""Logits that are computed only if something reads them.

A patched LM head (``heads.py``) returns a :class:`LazyLogits` in place of ``head(hidden)`` when the
model will compute its loss: a tensor with the logits' shape, dtype and device but no storage. The
model's own code between the head and its loss may scale and softcap it (``logits / cap``, ``tanh``,
``* cap``; ``/ logits_scaling``; ``.float()``): those ops stay lazy and are folded into one
:class:`~tiledmlp.kernels.cross_entropy.LogitTransform`, so the tiled loss gets the hidden states, the
head and the transform, and no ``tokens x vocab`` tensor is ever made.

Anything else that reads the logits — ``out.logits`` in user code, a metric, an op the loss cannot
fold, ``.numpy()``, ``.tolist()``, ``np.asarray``, pickling (the ``Trainer``'s evaluation loop) —
*materializes* them: the head's original forward runs on the kept hidden states and the
recorded ops are replayed, exactly as the untiled model would have computed them (bit for bit), and
the result is cached. Gradients through materialized logits flow to the hidden states and the head's
parameters through this tensor's own autograd node, as for an ``nn.Linear`` output. So a placeholder
is never a silently wrong tensor: it is the right tensor, late — or, once the head's parameters changed
since the forward (an optimizer step, through ``.data`` too), a ``ValueError`` saying to read the logits
before updating the model ([Note: a head changed before its logits are read]).

Costs: creating one is a few microseconds and one fingerprint of the head's parameters (a read of the
weight); it keeps a reference to the hidden states until the loss's backward begins ([Note: the hidden states after the
loss's backward]). Materializing costs what the untiled head costs.

[Note: the hidden states after the loss's backward]
The common loop keeps the model's output through backward (``outputs = model(**batch); outputs.loss.backward()``,
accelerate's examples), and with it this placeholder: had it kept the hidden states (``tokens x hidden``), they would
live through every layer's backward, after the loss's own backward no longer needs them, past the plan and an explicit
budget (measured: ``docs/long-context.md``, the two loops). The Trainer's loop drops the output before backward, so the
two loops differed by exactly that. So the placeholder lets go of them when the loss's backward begins (a pre-hook on
the loss's node; the loss's own saved tensors keep what its backward needs until it has run): both loops then hold the
same, the plan's. Reading the logits after that raises a ``ValueError`` saying to read them before ``loss.backward()``;
before it, they are computed as always.

[Note: a head changed before its logits are read]
An optimizer that writes through ``.data`` (bitsandbytes' 8-bit Adam, DeepSpeed's ZeRO copying its updated
partitions back, ``torch.nn.utils.vector_to_parameters``, which replaces ``.data``) bumps no version counter, so
versions cannot say whether the head changed (they did not: logits read after such a step were the new weights',
silently). The head's parameters are fingerprinted instead when the placeholder is made (:func:`fingerprint`: the
sum of their bits read as 64-bit integers, modulo 2**64), and compared when the logits are computed. An integer sum
is exact and independent of the order it is added in, so any one element changed changes it, NaNs included.
Right or refused: the old weights are not kept (a copy of the head per step), so a changed head is a ``ValueError``
naming the fix. Cost: one read of the head's weight per call with labels, beside the tiled loss's ``6 T H V`` FLOP
and its reads of that weight per shard (``docs/loss.md`` has the measured share). Held: one integer per parameter.
The hidden states are an activation, which nothing writes through ``.data``: their version counter stands for them,
or, under ``torch.inference_mode`` (whose tensors track no version), their fingerprint. Everything else the logits
depend on was computed before the head (the final norm's output is the hidden states kept); the scalar of a folded
scaling is replayed from a copy, and one that requires grad (a learned scale) is not folded (the folded loss would
give it no gradient): the loss then refuses the model, naming it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from ..core.function import AutocastReplay
from ..distributed.deepspeed import gathered, gathered_for_backward, is_zero3_param
from ..distributed.detect import is_dtensor, storage_freed
from ..kernels.cross_entropy import LogitTransform
from .cross_entropy import compute_dtype

__all__ = ["LazyLogits", "LogitsRecipe", "lazy_logits", "fingerprint"]

aten = torch.ops.aten
_ALIASES = (aten.detach.default, aten.alias.default)
_SCALINGS = {aten.mul.Tensor: False, aten.mul.Scalar: False, aten.div.Tensor: True, aten.div.Scalar: True}


class LogitsRecipe:
    """How the base logits ``F.linear(hidden, weight, bias)`` of a plain ``nn.Linear`` head are computed
    when needed: under the autocast state of the call that made the placeholder, from the tensors it
    read then. Materializing raises a ``ValueError`` when they cannot be used any more: storage freed
    (an FSDP unit resharded the head) or their values changed since (an optimizer step) — the untiled
    logits were computed before either. ``on_materialize`` is told the op that forced it (the tiled
    loss refuses logits that the model materialized before its loss). [Note: a head changed before its logits are read]
    says how a change is seen."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 on_materialize: Callable[[str], None] = lambda op: None) -> None:
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.on_materialize = on_materialize
        self._autocast = AutocastReplay()
        self._marks = self._marks_now()

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.hidden, self.weight, self.bias) if t is not None]

    def _marks_now(self) -> list[Any]:
        """What stands for each tensor's values ([Note: a head changed before its logits are read]): the hidden states'
        version, the parameters' fingerprints (a ZeRO-3 parameter's: its partition's, which is what its optimizer step
        overwrites)."""
        hidden = self.hidden
        marks: list[Any] = [fingerprint(hidden) if hidden.is_inference() else hidden._version]
        for p in self.head_params():
            marks.append(fingerprint(p.ds_tensor if is_zero3_param(p) else p.to_local() if is_dtensor(p) else p))
        return marks

    def compute(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        with self._autocast():
            return F.linear(hidden, weight, bias)

    def head_params(self) -> list[torch.Tensor]:
        """The head's weight and bias: under ZeRO-3 partitioned again after the forward, gathered (a collective over
        the engine's ranks, which all read the logits, as the ``Trainer``'s evaluation does) to compute them."""
        return [t for t in (self.weight, self.bias) if t is not None]

    def base_logits(self) -> torch.Tensor:
        """``F.linear(hidden, weight, bias)`` as the call computed it, without autograd history."""
        with torch.no_grad(), gathered(self.head_params()):
            return self.compute(self.hidden, self.weight, self.bias)

    def release(self) -> None:
        """The loss's backward has begun: the hidden states are no longer the placeholder's to keep 
        ([Note: the hidden states after the loss's backward])."""
        self.hidden = None

    def check(self) -> None:
        if self.hidden is None:
            raise ValueError(
                "these logits were never computed (tiledmlp computed the loss without them), and the hidden states "
                "they are computed from were freed when the loss's backward began, so that they are not held "
                "through the whole backward (tokens x hidden x 2 bytes). Read out.logits before loss.backward(), "
                "call the model without labels to get real logits, or enable tiling with loss=False.")
        if any(is_dtensor(t) or storage_freed(t) for t in self._tensors()):
            raise ValueError(
                "these logits were never computed (tiledmlp computed the loss without them) and the head's "
                "weights are no longer gathered (an FSDP unit resharded them after forward). Read the logits "
                "inside the model's forward, call the model without labels to get real logits, or enable "
                "tiling with loss=False.")
        if not all(map(_same, self._marks_now(), self._marks)):
            raise ValueError(
                "these logits were never computed (tiledmlp computed the loss without them), and the hidden "
                "states or the head's weights changed in place since that forward (an optimizer step, also one "
                "writing through .data such as bitsandbytes' 8-bit optimizers?), so they can no longer be "
                "computed as they were. Read out.logits before updating the model, or enable tiling with "
                "loss=False.")


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s bits read as integers (a 0-dim int64 tensor on ``t``'s device; no synchronization): the same
    for the same bits, whatever the order of the sum, and changed by any one element changed (the module's design
    note). Read as 64-bit words where the layout allows (a vectorized sum, as fast as a float one), else
    element by element."""
    t = t.detach()
    nbytes = t.element_size() * t.numel()
    if t.is_contiguous() and nbytes % 8 == 0 and (t.storage_offset() * t.element_size()) % 8 == 0:
        bits = t.reshape(-1).view(torch.int64)
    else:
        bits = t.view(_BITS[t.element_size()])
    with torch.no_grad():
        return bits.sum(dtype=torch.int64)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same(now: Any, then: Any) -> bool:
    """Two marks of :meth:`LogitsRecipe._marks_now` (a version, or a fingerprint tensor) say the same values."""
    return bool(torch.equal(now, then)) if isinstance(now, torch.Tensor) else now == then


@dataclass
class _Fold:
    """The ops applied so far, as ``b * tanh(a * z)`` (``tanh``) or ``a * z``."""

    a: float = 1.0
    tanh: bool = False
    b: float = 1.0

    def then(self, op: Any, value: Optional[float]) -> Optional["_Fold"]:
        """After a tanh (``value`` None) or a scaling by ``value``; None: tanh of a tanh."""
        if op is aten.tanh.default:
            return None if self.tanh else _Fold(self.a, True, 1.0)
        return _Fold(self.a, True, self.b * value) if self.tanh else _Fold(self.a * value, False, 1.0)

    def transform(self) -> Optional[LogitTransform]:
        if not self.tanh:
            return LogitTransform(self.a)
        if self.b <= 0:  # b * tanh(a z) with b <= 0 is no softcap
            return None
        return LogitTransform(scale=self.a * self.b, softcap=self.b)


@dataclass
class _Cell:
    """The materialized value, shared by a placeholder and its aliases (so an in-place op on one is
    seen through the others, as with real aliases)."""

    value: Optional[torch.Tensor] = None


@dataclass
class _State:
    recipe: LogitsRecipe
    ops: tuple = ()  # (op, args after self, kwargs) to replay on the base logits
    fold: _Fold = field(default_factory=_Fold)
    cell: _Cell = field(default_factory=_Cell)


class LazyLogits(torch.Tensor):
    """A placeholder for logits (see the module docstring). ``transform`` is what the ops applied to it
    amount to (ops it cannot represent materialize the logits instead)."""

    _lazy: _State
    __torch_function__ = torch._C._disabled_torch_function_impl  # results are plain tensors

    @staticmethod
    def __new__(cls, state: _State, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                requires_grad: bool = False) -> "LazyLogits":
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)
        t._lazy = state
        return t

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"materialized={self.materialized})")

    @property
    def hidden(self) -> torch.Tensor:
        return self._lazy.recipe.hidden

    @property
    def recipe(self) -> LogitsRecipe:
        return self._lazy.recipe

    @property
    def transform(self) -> LogitTransform:
        return self._lazy.fold.transform()  # a placeholder only holds representable folds (_fold_step)

    @property
    def materialized(self) -> bool:
        return self._lazy.cell.value is not None

    def materialize(self, reason: str = "materialize") -> torch.Tensor:
        """The real logits (computed once; a plain tensor without autograd history)."""
        state = self._lazy
        if state.cell.value is None:
            recipe = state.recipe
            recipe.check()
            value = recipe.base_logits()
            with torch.no_grad():
                for op, args, kwargs in state.ops:
                    value = op(value, *args, **kwargs)
            state.cell.value = value
            recipe.on_materialize(reason)
        return state.cell.value

    # Reads that do not reach ``__torch_dispatch__``: the tensor methods that look at storage or leave torch.
    # Each answers from the materialized logits, as it would from a plain tensor.

    def numpy(self, *, force: bool = False) -> Any:
        return self.materialize("numpy").numpy(force=force)

    def tolist(self) -> Any:
        return self.materialize("tolist").tolist()

    def data_ptr(self) -> int:
        return self.materialize("data_ptr").data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return self.materialize("untyped_storage").untyped_storage()

    def __reduce_ex__(self, protocol: int) -> Any:  # pickle, torch.save: the values, as a plain tensor
        return self.materialize("pickle").__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        if not self.is_leaf:  # as a plain tensor would
            raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                               "protocol at the moment. If you were attempting to deepcopy a module, this may be "
                               "because of a torch.nn.utils.weight_norm usage, see "
                               "https://github.com/pytorch/pytorch/pull/103001")
        return copy.deepcopy(self.materialize("deepcopy"), memo)

    def _derived(self, op: Any, args: tuple, kwargs: dict, fold: _Fold, dtype: torch.dtype) -> "LazyLogits":
        """The placeholder of ``op(self, *args, **kwargs)``. A tensor argument (a scale kept as a 0-dim tensor) is
        replayed from a copy: the fold took its value now, and an optimizer step may change the tensor before the
        logits are read."""
        state = self._lazy
        args = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
        return LazyLogits(_State(state.recipe, state.ops + ((op, args, kwargs),), fold), self.shape, dtype, self.device)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        self = args[0] if args and isinstance(args[0], LazyLogits) else None
        if self is not None and not self.materialized:
            rest = args[1:]
            if func in _ALIASES or (func is aten.view.default and _same_shape(self, rest[0])):
                # an alias (view_as: what a module's backward hooks do to its outputs) stays a placeholder
                return LazyLogits(self._lazy, self.shape, self.dtype, self.device)
            if func is aten.clone.default and not kwargs:
                state = self._lazy
                return LazyLogits(_State(state.recipe, state.ops, state.fold), self.shape, self.dtype, self.device)
            folded = _fold_step(self, func, rest, kwargs)
            if folded is not None:
                return folded
        reason = _materialized_by(func, args)
        real = lambda a: a.materialize(reason) if isinstance(a, LazyLogits) else a  # noqa: E731
        return func(*tree_map(real, args), **tree_map(real, kwargs))


def _materialized_by(func: Any, args: tuple) -> str:
    """The op that materializes the logits, in the words the tiled loss's refusal uses."""
    if func in _SCALINGS and torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and not isinstance(a, LazyLogits) and a.requires_grad for a in args):
        return f"{func} by a tensor that requires grad (a learned scale, which a folded loss would not train)"
    return str(func)


def _same_shape(t: torch.Tensor, size: Any) -> bool:
    """Whether ``t.view(size)`` has ``t``'s shape (a ``-1`` resolved)."""
    try:
        return torch.empty(t.shape, device="meta").view(size).shape == t.shape
    except RuntimeError:
        return False


def _scalar(value: Any) -> Optional[float]:
    """A Python number, or the value of a 0-dim (or one-element) plain tensor; None otherwise, and for a tensor that
    will get a gradient (a learned logit scale): the loss takes the fold as a constant, which would give it none."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if (isinstance(value, torch.Tensor) and not isinstance(value, LazyLogits) and value.numel() == 1
            and not (value.requires_grad and torch.is_grad_enabled())):
        return float(value.item())
    return None


def _fold_step(self: LazyLogits, func: Any, rest: tuple, kwargs: dict) -> Optional[LazyLogits]:
    """The lazy result of a scaling, tanh or upcast of ``self``; None when the op must materialize
    (another op, or a chain the loss cannot represent, such as tanh twice or a negative softcap)."""
    fold = self._lazy.fold
    folded, dtype = None, self.dtype
    if func in _SCALINGS and len(rest) == 1 and not kwargs:
        value = _scalar(rest[0])
        if value is not None and value != 0:
            folded = fold.then(func, 1.0 / value if _SCALINGS[func] else value)
            dtype = func(torch.empty(1, dtype=self.dtype, device="meta"), *rest).dtype
    elif func is aten.tanh.default and not rest and not kwargs:
        folded = fold.then(func, None)
    elif func is aten._to_copy.default and not rest and set(kwargs) == {"dtype"}:
        dtype = kwargs["dtype"]
        if dtype.is_floating_point and torch.finfo(dtype).bits > torch.finfo(self.dtype).bits:
            folded = fold  # an upcast is exact, and the loss computes in float32 anyway
    if folded is None or folded.transform() is None:
        return None
    return self._derived(func, rest, kwargs, folded, dtype)


class _LazyHead(torch.autograd.Function):
    """Makes the placeholder an output of ``(hidden, weight, bias)`` for autograd. Its backward does work only
    when materialized logits are differentiated; it is then the ``nn.Linear`` backward. It also runs, with no
    gradient, where a wrapper passes every output through a node of its own (DDP's ``_DDPSink`` with
    ``find_unused_parameters`` or ``static_graph``): that is not a read, and needs neither the hidden states (let go
    as the loss's backward began) nor the head."""

    @staticmethod
    def forward(ctx, state: _State, shape: torch.Size, dtype: torch.dtype, hidden: torch.Tensor,
                weight: torch.Tensor, bias: Optional[torch.Tensor]) -> LazyLogits:
        ctx.recipe = state.recipe  # holds hidden and the parameters by reference (nothing is copied)
        ctx.set_materialize_grads(False)  # no gradient stays None: not a tensor of zeros to multiply through
        return LazyLogits(state, shape, dtype, hidden.device)

    @staticmethod
    def backward(ctx, grad: Optional[torch.Tensor]):
        if grad is None or not any(ctx.needs_input_grad[3:]):
            return (None,) * 6
        recipe: LogitsRecipe = ctx.recipe
        recipe.check()
        # ZeRO-3: the head gathered again, each trainable parameter until its gradient is accumulated
        with torch.enable_grad(), gathered_for_backward(recipe.head_params()):
            leaves = [None if t is None else t.detach().requires_grad_(need)
                      for t, need in zip((recipe.hidden, recipe.weight, recipe.bias), ctx.needs_input_grad[3:])]
            out = recipe.compute(*leaves)
            grads = iter(torch.autograd.grad(out, [t for t in leaves if t is not None and t.requires_grad], grad))
        return (None, None, None, *[next(grads) if t is not None and t.requires_grad else None for t in leaves])


def lazy_logits(recipe: LogitsRecipe) -> LazyLogits:
    """A placeholder for ``F.linear(recipe.hidden, recipe.weight, recipe.bias)`` that autograd connects
    to the hidden states and the head's parameters."""
    hidden, weight = recipe.hidden, recipe.weight
    shape = torch.Size((*hidden.shape[:-1], weight.shape[0]))
    return _LazyHead.apply(_State(recipe), shape, compute_dtype(hidden, weight), hidden, weight, recipe.bias)
