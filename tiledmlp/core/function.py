"""The tiled autograd function: one autograd node for the whole MLP, shards inside it.

[Note: why parameters are explicit inputs]
The anchors (Liger, DeepSpeed, Axolotl, Unsloth) call ``torch.autograd.backward`` once per shard, so
every parameter's ``AccumulateGrad`` node — and every hook a wrapper put on it (DDP's reducer, FSDP1's
post-backward) — fires once per shard. Here the parameters are inputs of :class:`TiledMLPFunction`.
Backward recomputes each shard against *detached leaf copies* of the parameters, asks the form for the
shard's gradients (no ``AccumulateGrad``, no hook, no collective can run on a detached leaf), sums them,
and returns the sums. Autograd then accumulates each parameter's gradient exactly once per backward, as
for any other op, so every data-parallel wrapper sees an ordinary node.

[Note: what stays alive]
Forward saves only the token matrix ``x`` (``[tokens, hidden]``) with ``save_for_backward``, so
saved-tensor hooks (activation offload, non-reentrant checkpointing) see it. Parameters are held by
reference on ``ctx`` and are *not* saved: an offload hook would otherwise copy weights to the host, and
FSDP re-materializes the same unsharded tensors before this node's backward runs. Outputs and the input
gradient are written shard by shard into buffers allocated once (no ``torch.cat`` doubling), and every
shard but the last has the same size, so the caching allocator reuses one set of per-shard temporaries.

[Note: checkpointing without a third forward]
Under activation checkpointing a tiled MLP would run its forward three times: forward, checkpoint's
recompute, and the per-shard recompute in its own backward. The tiled node therefore saves nothing
itself: a tiny identity node in front of it (:class:`_InputKeeper`) saves ``x`` and the tiled node
reads it from there in backward. In the original forward that save is the last one of the MLP, so
non-reentrant checkpointing (``use_reentrant=False``), whose recompute stops as soon as every saved
tensor is back (``early_stop``), stops *before* the tiled forward runs whenever nothing after the MLP
in the checkpointed region saves a tensor (Llama-style ``residual + mlp(x)``). The MLP's forward then
runs twice, not three times, and a checkpointed tiled layer does less MLP work than a checkpointed
untiled one (22 vs 24 · tokens · hidden · intermediate FLOP). Reentrant checkpointing has no early
stop and still runs three forwards.

[Note: gradients finished in forward]
A loss is the last op of a step and its output is summed right away, so every output element gets the
same upstream gradient ``c`` (1 for ``loss.backward()``). A form with ``grads_in_forward`` (the tiled
linear cross-entropy) exploits that: each forward shard also computes its input gradient and adds its
weight gradients to the accumulator *for an upstream gradient of ones*, while its intermediates (the
shard's logits) are still in hand, so nothing is ever recomputed. Backward only scales them by ``c``
(nothing to do for ``c == 1``) and hands them out, once. The node then keeps no ``x``: its backward
needs none, and its gradients reach autograd, hence every wrapper, exactly as a recomputing node's do.

Memory: forward keeps ``O(tokens * hidden)``; backward's transient peak is one shard's intermediates
plus one gradient accumulator per trainable parameter (a ``grads_in_forward`` form holds its input
gradient and accumulators from forward to backward instead). No communication happens in this module.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Optional, Sequence

import torch
from torch.profiler import record_function

from .accumulate import GradAccumulator
from .form import Form, TileCall, shard_bounds

__all__ = ["AutocastReplay", "SHARD_DEPTH", "ShardDepth", "backward_shards", "forward_shards", "run_tiled", "in_shard"]


class ShardDepth(threading.local):
    """How many forms' shards this thread is computing, one inside another (``depth``; 0: none), so that a tiled
    module called from inside a shard runs untiled. Written only by this module, around each shard; read from outside
    as a plain attribute (:data:`SHARD_DEPTH`), which a patched module's every call checks without a call into core."""

    depth: int = 0  # per thread: a class attribute is every new thread's starting value


#: This thread's shard depth (:class:`ShardDepth`): read it, never write it.
SHARD_DEPTH = ShardDepth()


_TWICE = ("tiledmlp: a tiled MLP or loss computes its gradients shard by shard, once, so it cannot be "
          "differentiated twice (create_graph=True, gradient penalties, Hessian-vector products). Disable tiling "
          "for this computation: tiledmlp.disable_tiling(model) (enable_tiling restores it).")


def _once_differentiable(backward):
    """``torch.autograd.function.once_differentiable``, with an error that names tiling and the fix when a
    second backward reaches the node (the first, with ``create_graph=True``, succeeds as usual)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled() or not any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads):
            return outputs
        delayed = torch._C._functions.DelayedError(_TWICE, len(outputs))
        return delayed(*[None if o is None else o.detach().requires_grad_() if o.is_floating_point() else o
                         for o in outputs])

    return wrapper


def _refuse_functorch() -> None:
    """torch.func transforms (grad, vmap, jacrev, ...) would fail inside autograd with an error about
    ``setup_context``; say instead that tiling is the cause, and the fix."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    if peek is not None and peek() is not None:
        raise RuntimeError("tiledmlp: tiled modules do not support torch.func transforms (grad, vmap, jacrev, "
                           "functional_call under grad): their shards run inside one autograd node. Disable tiling "
                           "for this computation: tiledmlp.disable_tiling(model).")


def in_shard() -> bool:
    """True while a form computes one shard (so a tiled module called from inside it runs untiled)."""
    return SHARD_DEPTH.depth > 0


@contextlib.contextmanager
def _shard_scope():
    SHARD_DEPTH.depth += 1
    try:
        yield
    finally:
        SHARD_DEPTH.depth -= 1


class _RngReplay:
    """Captures the RNG state at forward and replays it for the recompute (like ``checkpoint`` does)."""

    def __init__(self, device: torch.device) -> None:
        self.devices = [device] if device.type not in ("cpu", "meta") else []
        self.cpu_state = torch.get_rng_state()
        self.device_states = [torch.get_device_module(d).get_rng_state(d) for d in self.devices]

    @contextlib.contextmanager
    def replay(self):
        with torch.random.fork_rng(devices=self.devices, device_type=self.devices[0].type if self.devices else "cuda"):
            torch.set_rng_state(self.cpu_state)
            for d, s in zip(self.devices, self.device_states):
                torch.get_device_module(d).set_rng_state(s, d)
            yield


class AutocastReplay:
    """Re-enters the forward's autocast state in backward, so a recompute rounds like the forward did."""

    _DEVICES = ("cuda", "cpu")

    def __init__(self) -> None:
        self.states = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in self._DEVICES]

    def __call__(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for device, enabled, dtype in self.states:
            # Only touch devices whose state differs: a disabled "cuda" autocast warns on CPU-only builds.
            if enabled or torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device_type=device, dtype=dtype, enabled=enabled))
        return stack


def forward_shards(call: TileCall, x: torch.Tensor, params: Sequence[torch.Tensor],
                    token_inputs: Sequence[torch.Tensor] = (), dx: Optional[torch.Tensor] = None,
                    grads: Optional[GradAccumulator] = None) -> tuple[Optional[torch.Tensor], ...]:
    """Run every shard and write its outputs into buffers allocated once, at the first shard.

    The buffers have their final shape (the input's leading dims for token-leading outputs), so the
    tiled node returns them as they are, not as views (FSDP2 warns about views returned by a unit).
    With ``grads`` (a ``grads_in_forward`` form) each shard also writes its rows of ``dx``.
    """
    buffers: list[Optional[torch.Tensor]] = []
    rows_view: list[Optional[torch.Tensor]] = []  # each buffer seen as [tokens, ...]
    rows = x.shape[0]
    params = _expanded(call.form, params)
    for idx, (start, stop) in enumerate(shard_bounds(rows, call.forward_rows or call.shard_rows)):
        # The first shard's outputs size the buffers; later shards may be computed straight into them.
        dests = None if idx == 0 else tuple(None if v is None else v[start:stop] for v in rows_view)
        side = tuple(t[start:stop] for t in (*token_inputs, *call.side))
        in_forward = {} if grads is None else {"dx_out": None if dx is None else dx[start:stop], "grads": grads}
        with record_function("tiledmlp::forward_shard"), _shard_scope():
            outs = call.form.forward_shard(x[start:stop], params, dests, side, **in_forward)
        if idx == 0:
            for o, leading in zip(outs, call.form.leading_outputs):
                buf = None if o is None else o.new_empty((*(call.lead_shape if leading else (rows,)), *o.shape[1:]))
                buffers.append(buf)
                rows_view.append(None if buf is None else buf.view(rows, *o.shape[1:]))
            dests = tuple(None if v is None else v[start:stop] for v in rows_view)
        for dest, o in zip(dests, outs):
            if dest is not None and o is not dest:
                dest.copy_(o)
    return tuple(buffers)


class _InputKeeper(torch.autograd.Function):
    """Identity that saves ``x`` for the tiled node (see "checkpointing without a third forward")."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class TiledMLPFunction(torch.autograd.Function):
    """``outputs = MLP(x)`` computed shard by shard; gradients accumulated once per backward.

    Inputs: a :class:`TileCall`, the token matrix ``x`` (``[tokens, hidden]``, contiguous), the
    :class:`_InputKeeper` node that saved ``x`` (None when ``x`` needs no grad: then this node saves
    it), the number ``n`` of token inputs, then the ``n`` token inputs (token-aligned tensors beside
    ``x``, e.g. a MoE layer's routing weights, saved here: they are small) and every parameter tensor
    the form reads (trainable or frozen; frozen ones get ``None``).
    """

    @staticmethod
    def forward(ctx, call: TileCall, x: torch.Tensor, keeper: Optional[Any], n: int, *tensors: torch.Tensor):
        token_inputs, params = tensors[:n], tensors[n:]
        ctx.n = n
        ctx.call = call
        ctx.params = params  # by reference, deliberately not saved (see [Note: what stays alive])
        ctx.rng = _RngReplay(x.device) if call.form.stochastic else None
        ctx.autocast = AutocastReplay()
        ctx.keeper = keeper
        ctx.forward_grads = None
        if call.form.grads_in_forward:  # see "gradients finished in forward": nothing to keep but them
            if n:
                raise ValueError("a form that finishes its gradients in forward takes no token inputs")
            needs_x = ctx.needs_input_grad[1]
            grads = call.accumulator(params, ctx.needs_input_grad[4:], x.shape[0])
            dx = torch.empty_like(x) if needs_x else None
            with record_function("tiledmlp::forward"):
                outs = forward_shards(call, x, params, (), dx, grads)
            ctx.forward_grads = [dx, *grads.results()]
            ctx.around_delivery = call.around_delivery
            ctx.call = ctx.params = None  # backward needs neither: release the form's scratch and side inputs
        else:
            ctx.save_for_backward(*token_inputs, *((x,) if keeper is None else ()))
            with record_function("tiledmlp::forward"):
                outs = forward_shards(call, x, params, token_inputs)
        # How backward sees each output gradient: [tokens, ...], like the form's shard outputs.
        ctx.rows_shapes = [None if o is None else (x.shape[0], *o.shape[len(call.lead_shape) if leading else 1:])
                           for o, leading in zip(outs, call.form.leading_outputs)]
        ctx.mark_non_differentiable(*[o for o in outs if o is not None and not o.is_floating_point()])
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    @_once_differentiable
    def backward(ctx, *grad_outputs: Optional[torch.Tensor]):
        call: Optional[TileCall] = ctx.call
        if call is None:  # the gradients were finished in forward
            with ctx.around_delivery():
                dx, *param_grads = _hand_out_forward_grads(ctx, grad_outputs)
            return (None, dx, None, None, *param_grads)
        n, saved = ctx.n, ctx.saved_tensors
        (x,) = ctx.keeper.saved_tensors if ctx.keeper is not None else saved[n:]
        grad_outputs = [None if g is None else g.reshape(shape) for g, shape in zip(grad_outputs, ctx.rows_shapes)]
        rng = ctx.rng.replay() if ctx.rng is not None else contextlib.nullcontext()
        with rng, ctx.autocast():
            dx, d_inputs, param_grads = backward_shards(call, x, ctx.params, saved[:n], grad_outputs,
                                                        ctx.needs_input_grad[1], ctx.needs_input_grad[4:])
        return (None, dx, None, None, *d_inputs, *param_grads)


def backward_shards(call: TileCall, x: torch.Tensor, params: Sequence[torch.Tensor],
                    token_inputs: Sequence[torch.Tensor], grad_outputs: Sequence[Optional[torch.Tensor]],
                    needs_x: bool, needs: Sequence[bool]) -> tuple[Optional[torch.Tensor], list, list]:
    """``(dx, token inputs' gradients, parameters' gradients)`` of one tiled call, recomputing it shard by
    shard inside the strategy's backward context. ``grad_outputs`` are seen as ``[tokens, ...]``;
    ``needs``: per token input, then per parameter, whether it wants a gradient."""
    n = len(token_inputs)
    grads = call.accumulator(params, needs[n:], x.shape[0])
    dx = torch.empty_like(x) if needs_x else None
    d_inputs = [torch.empty_like(t) if need else None for t, need in zip(token_inputs, needs)]
    if all(g is None for g in grad_outputs):  # no output was used: nothing to recompute
        zeros = [None if t is None else t.zero_() for t in (dx, *d_inputs)]
        return zeros[0], zeros[1:], grads.results()
    with record_function("tiledmlp::backward"), call.around_backward():
        params = _expanded(call.form, params)
        for start, stop in shard_bounds(x.shape[0], call.shard_rows):
            shard_grads = [None if g is None else g[start:stop] for g in grad_outputs]
            side = tuple(t[start:stop] for t in (*token_inputs, *call.side))
            extra = {"dside_out": [None if d is None else d[start:stop] for d in d_inputs]} if n else {}
            with record_function("tiledmlp::backward_shard"), _shard_scope():
                call.form.backward_shard(
                    x[start:stop], shard_grads, params, None if dx is None else dx[start:stop], grads, side, **extra
                )
    return dx, d_inputs, grads.results()


def _expanded(form: Form, params: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """What one pass's shards compute with (the form's optional ``expand``)."""
    expand = getattr(form, "expand", None)
    return params if expand is None else expand(params)


def _hand_out_forward_grads(ctx, grad_outputs: Sequence[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
    """The gradients a ``grads_in_forward`` form finished in forward, scaled by the upstream gradient.

    They were computed for ones on every output element; the caller sums the outputs, so the upstream
    gradient is one value ``c`` everywhere (checked: anything else is refused, never approximated).
    They are handed out once and not kept, so autograd can make them the ``.grad`` without a copy.
    """
    grads = ctx.forward_grads
    if grads is None:
        raise RuntimeError("backward ran twice through a tiled node whose gradients were computed in forward "
                           "(a tiled loss): they were handed out the first time. Recompute the loss for a "
                           "second backward instead of retain_graph=True.")
    ctx.forward_grads = None
    given = [g for g in grad_outputs if g is not None]
    if not given:
        return [None] * len(grads)
    c = given[0].reshape(-1)[:1]
    uniform, is_one = torch.stack([torch.stack([(g == c).all() for g in given]).all(), (c == 1).all()]).tolist()
    if not uniform:
        raise RuntimeError("a tiled node that finishes its gradients in forward got different upstream gradients "
                           "for its outputs; it needs its outputs summed (tiledmlp's loss functions do this)")
    if not is_one:
        for t in grads:
            if t is not None:
                t.mul_(c)  # in float32, rounded once to the gradient's dtype
    return grads


def run_tiled(call: TileCall, x: torch.Tensor, params: Sequence[torch.Tensor],
              token_inputs: Sequence[torch.Tensor] = ()) -> tuple[Optional[torch.Tensor], ...]:
    """Compute ``call.form`` over the token matrix ``x`` in shards of ``call.shard_rows`` tokens.

    ``token_inputs``: tensors whose first dim is ``x``'s tokens, cut into the same rows and differentiated
    like ``x`` (a MoE layer's routing indices and weights: the weights' gradient reaches the router). Builds
    the autograd node only when something needs a gradient; under ``torch.no_grad()`` (or with nothing
    trainable) the shards run without any graph, so inference gets the same memory savings.
    """
    _refuse_functorch()
    if not x.is_contiguous():
        x = x.contiguous()
    for t in token_inputs:
        if t.shape[:1] != x.shape[:1]:
            raise ValueError(f"a token input of shape {tuple(t.shape)} does not have the input's {x.shape[0]} tokens "
                             "as its first dim")
    tensors = (*token_inputs, *params)
    if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in tensors)):
        n = len(token_inputs)
        if x.requires_grad and not call.form.grads_in_forward:
            x = _InputKeeper.apply(x)
            return TiledMLPFunction.apply(call, x, x.grad_fn, n, *tensors)
        return TiledMLPFunction.apply(call, x, None, n, *tensors)
    with torch.no_grad():
        return forward_shards(call, x, params, token_inputs)
