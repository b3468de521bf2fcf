"""The contract between the tiled function and the forms: :class:`Form` (how one shard is computed and
differentiated, which ``tiledmlp.forms`` implements) and :class:`TileCall` (what one tiled call computes and how it
is cut). ``function.py`` runs a :class:`TileCall`; a form never sees the autograd node around it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Protocol, Sequence

import torch

from .accumulate import GradAccumulator

__all__ = ["Form", "ShardScratch", "TileCall", "shard_bounds"]


class ShardScratch(Protocol):
    """What one shard of a form holds per token beyond its input and output, as the form declares it
    (``tiledmlp.forms``): all the shard policy needs to cut a call (``tiledmlp.core.sharding``), and what the memory
    plan counts (``tiledmlp.plan.memory``). Compared by value: a call's cut is remembered per scratch and sizes."""

    #: the most blocks the form's intermediate dimension can be cut into in backward (1: none)
    max_blocks: int

    def backward_bytes_per_token(self, blocks: int) -> int:
        """Bytes per token of a backward shard whose intermediate dimension is computed in ``blocks`` blocks."""

    def forward_bytes_per_token(self) -> int:
        """Bytes per token of a forward shard (blocks do not split it)."""


class Form(Protocol):
    """How one MLP is computed from a token shard and its parameter tensors (``tiledmlp.forms``)."""

    #: True when the computation draws random numbers (dropout, router jitter): the RNG state is then
    #: captured in forward and replayed so that backward recomputes the same shards.
    stochastic: bool

    #: per output of the last ``forward_shard``: does it carry the input's leading dims (else it is
    #: returned as ``[tokens, ...]``)
    leading_outputs: tuple[bool, ...]
    #: whether the module returns a tuple (else its single output is returned alone)
    returned_tuple: bool

    #: True when ``forward_shard`` also finishes the shard's gradients (``function.py``,
    #: [Note: gradients finished in forward]); such a form has no ``backward_shard``
    grads_in_forward: bool

    #: parameters (indices of the tensors handed to the form) whose shard gradients are summed in float32
    #: whatever ``grad_accum_dtype`` says: small ones where precision matters more than 2 bytes per element
    float32_sums: tuple[int, ...]

    # Optional: ``expand(params) -> params``, the tensors every shard of one pass computes with, made once per
    # pass (forward, backward) inside the strategy's context and dropped after it (4-bit weights dequantized:
    # ``tiledmlp.forms.quant``). Forms without it compute with the parameters as given.

    def forward_shard(self, x: torch.Tensor, params: Sequence[torch.Tensor],
                      out: Optional[Sequence[Optional[torch.Tensor]]] = None, side: Sequence[torch.Tensor] = (),
                      dx_out: Optional[torch.Tensor] = None,
                      grads: Optional["GradAccumulator"] = None) -> tuple[Optional[torch.Tensor], ...]:
        """Outputs for token rows ``x`` (``[rows, hidden]``), each token-leading (``[rows, ...]``) or None.

        ``out`` (from the second shard on) holds each output's destination rows in the tiled call's
        output buffers; a form may compute an output straight into its destination and return that
        very tensor, which saves the copy (forms are free to ignore ``out``). ``side`` holds the rows
        of the call's side inputs (``TileCall.side``). ``grads`` (with ``dx_out``, None when ``x``
        needs no gradient) is given to ``grads_in_forward`` forms when gradients are wanted: the form
        then also writes the shard's input gradient and adds its weight gradients, for an upstream
        gradient of ones on every output element.
        """

    def backward_shard(
        self,
        x: torch.Tensor,
        grad_outputs: Sequence[Optional[torch.Tensor]],
        params: Sequence[torch.Tensor],
        dx_out: Optional[torch.Tensor],
        grads: "GradAccumulator",
        side: Sequence[torch.Tensor] = (),
        dside_out: Sequence[Optional[torch.Tensor]] = (),
    ) -> None:
        """Recompute one shard; write its input gradient into ``dx_out`` and add weight grads to ``grads``.

        Called only when some output has a gradient: when none has, ``function.backward_shards`` zeroes the input
        gradients itself and calls no form, so a one-output form's ``grad_outputs[0]`` is never None.

        ``dside_out`` (given only to a call with token inputs, ``run_tiled(..., token_inputs=...)``)
        holds, per token input, the rows its gradient goes to (None: it needs none); ``side`` then
        starts with those inputs' rows."""


@dataclass
class TileCall:
    """Everything one tiled call needs besides the tensors: what to compute and how to cut it.

    ``lead_shape`` is the input's shape without its last dim: outputs whose leading dims are the
    tokens' (``form.leading_outputs``) are returned in that shape, the others as ``[tokens, ...]``.
    ``around_backward`` is the strategy's context for the recompute (e.g. an explicit FSDP2 unshard), and
    ``around_delivery`` the one for handing out gradients finished in forward (a ZeRO-3 gather: autograd
    accumulates into the parameter's current shape).
    ``forward_rows`` (default ``shard_rows``) cuts the forward differently from the backward; only a
    deterministic form may use it (a stochastic form's backward replays the forward's shards).
    ``side`` are token-aligned tensors that need no gradient (a loss's labels, per-token state a form
    keeps from forward to backward), cut into the same rows as ``x``; a form sees them after the call's
    token inputs (``run_tiled``'s ``token_inputs``, which may need gradients). ``partial_mib`` bounds the
    accumulators' partial-gradient buffer (``GradAccumulator``).
    """

    form: Form
    shard_rows: int
    lead_shape: tuple[int, ...]
    around_backward: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    around_delivery: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    grad_accum_dtype: Optional[torch.dtype] = None
    forward_rows: Optional[int] = None
    side: tuple[torch.Tensor, ...] = ()
    partial_mib: Optional[float] = None

    def __post_init__(self) -> None:
        if self.forward_rows not in (None, self.shard_rows) and self.form.stochastic:
            raise ValueError("a stochastic form must cut its forward like its backward: leave forward_rows None")
        if self.forward_rows not in (None, self.shard_rows) and self.form.grads_in_forward:
            raise ValueError("a form that finishes its gradients in forward has one cut: leave forward_rows None")

    def accumulator(self, params: Sequence[torch.Tensor], needs: Sequence[bool], rows: int) -> GradAccumulator:
        """The gradient accumulator of one pass over ``rows`` tokens in shards of ``shard_rows``."""
        return GradAccumulator(params, needs, len(shard_bounds(rows, self.shard_rows)), self.grad_accum_dtype,
                               self.partial_mib, self.form.float32_sums)


def shard_bounds(rows: int, shard_rows: int) -> list[tuple[int, int]]:
    return [(start, min(start + shard_rows, rows)) for start in range(0, rows, shard_rows)]
