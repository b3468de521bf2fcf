"""The probe: a candidate's own forward run on random tokens, compared with each fast form it allows (the
candidates and their layouts come from ``candidates.py``; ``mlp.py`` decides from the probe's answers).

[Note: the probe]
A module is a candidate when two to four of its direct children are Linear-like (``nn.Linear``,
Hugging Face ``Conv1D``, a peft LoRA-wrapped linear) and two of them chain ``hidden -> inter ->
hidden`` (``inter`` or ``2 * inter`` for a fused gate/up projection). The names do not matter.
For a candidate, the probe runs the module's own forward on a few random tokens, with random weights of
its projections' shapes (so that what it finds does not depend on how the weights were initialized: a
zero-initialized projection matches every candidate), and compares it with every fast form its children
allow:

* three projections: ``down(act(gate(x)) * up(x))`` for both gate/up assignments;
* two projections: ``down(act(up(x)))``, and ``down(act(u[:I]) * u[I:])`` for ``u = up(x)`` of
  twice the down projection's input width (fused gate/up);

each with every activation the kernels compute (``PROBE_ACTIVATIONS``, the kernels' table: SiLU, GELU exact and
tanh, ReLU, squared ReLU). The probe computes in float32 with full-precision matmuls (float32 copies of 16-bit
weights, for the probe only), on inputs scaled so the pre-activations span the range where the activations differ
(GELU and its tanh approximation differ by ~1e-4 relative there, float32 rounding ~1e-7). Exactly one candidate
must match within ``PROBE_RTOL``; none or several means generic. The probe also checks that the forward is
per-token (two halves of the probe tokens computed apart give the whole, which is what tiling relies on; attention
fails it) and that training mode computes the same thing (no dropout): a module that mixes tokens is never tiled,
one that differs in training mode gets the generic form, which replays it exactly.

Sharded parameters — FSDP2's or a tensor-parallel plan's DTensors — are gathered for the probe
(``full_tensor()``: one all-gather per parameter, at enable time, in the same order on every rank,
as ``enable_tiling`` runs on all of them). The children's hooks are suspended while it runs (the
probe's tokens are not the user's data; ``parallelize_module``'s would redistribute), so it sees what
the module computes on one device; a module whose children carry hooks of their own then takes the
generic form, which calls them (``tiledmlp.distributed.hooks``).

A peft LoRA-wrapped projection in its plain state (one active adapter, unmerged, no adapter dropout:
``tiledmlp.forms.lora``) is a projection with an adapter; the probe then computes with random adapter
weights (peft initializes ``B`` to zero, which would hide the adapter's term), so the match checks
the adapter's computation and scale as well.
"""


from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..core.compat import matmul_4bit
from ..distributed.detect import fsdp2_units_below, is_dtensor, whole_tensor
from ..distributed.hooks import silenced_hooks
from ..forms.base import Slot, dedupe, swapped
from ..forms.lora import LowRank
from ..forms.mlp import ACTIVATIONS, MLPForm, MLPLayout
from ..forms.quant import dequantizable, dequantize, quant_state_of
from .candidates import LinearLike

__all__ = ["Probe", "PROBE_RTOL", "PROBE_TOKENS", "PROBE_ACTIVATIONS", "exact_float32", "rel_max_err",
           "probe_unavailable", "dequantized_linear_problem"]

PROBE_RTOL = 1e-5  # largest relative max-error of a matching candidate (float32, full-precision matmuls)
PROBE_TOKENS = 16
PROBE_ACTIVATIONS = ACTIVATIONS  # every activation the fast forms compute: the kernels' table, tried in its order
_PRE_ACTIVATION_STD = 2.0  # the probe's pre-activations: where GELU and its tanh form differ most


@contextlib.contextmanager
def _mode(module: nn.Module, training: bool) -> Iterator[None]:
    """Every submodule's ``training`` flag set (not through ``train()``, which a module may
    override), restored on exit."""
    saved = [(m, m.training) for m in module.modules()]
    try:
        for m, _ in saved:
            m.training = training
        yield
    finally:
        for m, flag in saved:
            m.training = flag


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """Full-precision float32 matmuls (no TF32) and no autocast, restored on exit. A module changed since
    ``enable_tiling`` is probed again inside a training step, which may run under autocast (the Trainer's
    ``bf16=True``): the probe compares float32 computations, never autocast's."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with contextlib.ExitStack() as stack:
            for device in ("cpu", "cuda"):
                if torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            yield
    finally:
        torch.set_float32_matmul_precision(saved)


def rel_max_err(got: Any, ref: torch.Tensor) -> float:
    """Largest error relative to ``ref``'s largest magnitude; infinite for anything but a tensor of ``ref``'s
    shape (a forward that returned something else)."""
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape:
        return float("inf")
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class Probe:
    """The module's forward on probe tokens, with float32 copies of its parameters swapped in (made
    once, whatever input widths are tried); ``projections``: the Linear-like children, whose copies are random
    instead (see :meth:`_randomize_projection`). A 4-bit child (``tiledmlp.forms.quant``) is replaced by a plain linear
    of its shape, computing with such a copy, while the forward runs: its packed weight cannot be swapped."""

    def __init__(self, forward: Callable[..., Any], module: nn.Module, slots: Sequence[Slot],
                 adapters: Sequence[LowRank] = (), weights: Sequence[int] = (),
                 projections: Sequence[tuple[LinearLike, int, Optional[int]]] = ()) -> None:
        self.forward, self.module, self.slots = forward, module, slots
        full = [whole_tensor(p.detach()) if is_dtensor(p) else p.detach() for p in (s.get() for s in slots)]
        self.proxies = [p.float() if p.dtype in (torch.bfloat16, torch.float16) else p for p in full]
        gen = torch.Generator(device=self.proxies[0].device if self.proxies else "cpu").manual_seed(2)
        for lin, weight, bias in projections:
            self._randomize_projection(lin, weight, bias, gen)
        for adapter, weight in zip(adapters, weights):
            self._randomize(adapter, weight)
        self.unique, self.unique_index = dedupe(self.proxies)
        self.stand_ins = {lin.weight.owner: _StandIn(self.proxies[weight], None if bias is None else self.proxies[bias])
                          for lin, weight, bias in projections if lin.quant is not None}
        self.x = torch.empty(0)
        self.hidden = 0

    def _randomize_projection(self, lin: LinearLike, weight: int, bias: Optional[int], gen: torch.Generator) -> None:
        """Random weights (and bias) of the projection's shapes: the probe identifies what the forward computes,
        whatever the values are. With the real ones, a zero-initialized ``down_proj`` (weights not loaded yet)
        makes every candidate match, and a zero bias hides whether the forward adds it."""
        shape = (lin.in_features, lin.out_features) if lin.transposed else (lin.out_features, lin.in_features)
        for index, size, scale in ((weight, shape, lin.in_features ** -0.5), (bias, (lin.out_features,), 1.0)):
            if index is not None:
                t = self.proxies[index]
                dtype = t.dtype if t.is_floating_point() and lin.quant is None else torch.float32
                self.proxies[index] = torch.randn(size, generator=gen, device=t.device, dtype=dtype) * scale

    def _randomize(self, adapter: LowRank, weight: int) -> None:
        """Random ``A`` and ``B`` for a LoRA adapter (on the base weight at ``weight``), scaled so its term is
        as large as the base projection's: peft's zero-initialized ``B`` would hide what the adapter computes."""
        a, b = self.proxies[adapter.a], self.proxies[adapter.b]
        gen = torch.Generator(device=a.device).manual_seed(1)
        w_std = float(self.proxies[weight].std().clamp_min(1e-6))
        b_std = 1.0 / (max(abs(adapter.scale), 1e-6) * b.shape[1] ** 0.5)
        self.proxies[adapter.a] = torch.randn(a.shape, generator=gen, device=a.device, dtype=a.dtype) * w_std
        self.proxies[adapter.b] = torch.randn(b.shape, generator=gen, device=b.device, dtype=b.dtype) * b_std

    def tokens(self, hidden: int, reader: Optional[LinearLike], where: dict[tuple[int, str], int]) -> None:
        """Draw ``hidden``-wide probe tokens, scaled so ``reader`` (a child reading the input) gives
        pre-activations of standard deviation ``_PRE_ACTIVATION_STD``; unscaled without one (no child reads the input
        with a weight that is a parameter: a parametrized projection, or a registered module without Linear-like
        children; the tokens then only check that the module is per token)."""
        w = self.proxies[where[(id(reader.weight.owner), reader.weight.name)]] if reader is not None else None
        like = w if w is not None else self.proxies[0]
        dtype = like.dtype if like.dtype in (torch.float32, torch.float64) else torch.float32
        gen = torch.Generator(device=like.device).manual_seed(0)
        x = torch.randn(1, PROBE_TOKENS, hidden, generator=gen, device=like.device, dtype=dtype)
        if w is not None:
            pre = x @ (w if reader.transposed else w.t())
            x = x * (_PRE_ACTIVATION_STD / pre.std().clamp_min(1e-12))
        self.x = x
        self.hidden = hidden

    def given(self, x: torch.Tensor) -> None:
        """Use ``x`` (``[1, tokens, hidden]``) as the probe tokens."""
        self.x, self.hidden = x, x.shape[-1]

    def reference(self) -> Optional[torch.Tensor]:
        """The forward on the probe tokens, or None if it is not a per-token map from hidden states to
        hidden states: tiling computes token shards independently, so two halves of the tokens
        computed apart must give the whole. Raises what the forward raises."""
        half = PROBE_TOKENS // 2
        ref = self.run(self.x, training=False)
        parts = [self.run(self.x[:, :half], training=False), self.run(self.x[:, half:], training=False)]
        if (isinstance(ref, torch.Tensor) and ref.shape == self.x.shape
                and all(isinstance(p, torch.Tensor) for p in parts)
                and rel_max_err(torch.cat(parts, dim=1), ref) <= PROBE_RTOL):
            return ref
        return None

    def mixes_tokens(self) -> bool:
        """Whether the forward mixes tokens (a module registered as per-token: ``register_mlp``): changing either half
        of the probe tokens changes the other half's outputs, or an output does not scale with the tokens. Every
        run draws the same random numbers, so a module that draws a mask per token (dropout) is per-token here too.
        Raises what the forward raises."""
        half = PROBE_TOKENS // 2
        gen = torch.Generator(device=self.x.device).manual_seed(4)
        other = torch.randn(self.x.shape, generator=gen, device=self.x.device, dtype=self.x.dtype) * self.x.std()
        base = self._token_outputs(self.x)
        for changed, kept in ((slice(None, half), slice(half, None)), (slice(half, None), slice(None, half))):
            x = self.x.clone()
            x[:, changed] = other[:, changed]
            outs = self._token_outputs(x)
            if base is None or outs is None or len(outs) != len(base) or any(
                    rel_max_err(o[kept], b[kept]) > PROBE_RTOL for o, b in zip(outs, base)):
                return True
        return False

    def _token_outputs(self, x: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """The forward's tensor outputs on ``x`` (``[1, tokens, hidden]``), each as ``[tokens, -1]``, drawing the same
        random numbers every time; None if one is no tensor or does not lead with the tokens."""
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            out = self.run(x, training=False)
        tokens, flat = x.shape[1], []
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if o is None:
                continue
            if not isinstance(o, torch.Tensor):
                return None
            if tuple(o.shape[:2]) == (1, tokens):
                o = o[0]
            if o.dim() == 0 or o.shape[0] != tokens:
                return None
            flat.append(o.reshape(tokens, -1))
        return flat

    def run(self, *inputs: torch.Tensor, training: bool) -> Any:
        """The forward on ``inputs`` (the probe tokens, and for MoE experts their routing)."""
        with (torch.no_grad(), exact_float32(), _mode(self.module, training), swapped(self.slots, self.proxies),
              silenced_hooks(self.module), _standing_in(self.module, self.stand_ins)):
            return self.forward(*inputs)

    def candidate(self, layout: MLPLayout) -> torch.Tensor:
        with torch.no_grad(), exact_float32():
            return MLPForm(layout.remap(self.unique_index)).forward_shard(self.x[0], self.unique)[0]


class _StandIn(nn.Module):
    """A plain linear computing with a probe's copy of a 4-bit child's weight, in that child's place."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


@contextlib.contextmanager
def _standing_in(module: nn.Module, stand_ins: dict[nn.Module, nn.Module]) -> Iterator[None]:
    """Each key of ``stand_ins`` (a child somewhere below ``module``) replaced by its value, restored on exit."""
    places = [(parent, name, child) for parent in module.modules() for name, child in parent._modules.items()
              if child in stand_ins]
    try:
        for parent, name, child in places:
            parent._modules[name] = stand_ins[child]
        yield
    finally:
        for parent, name, child in places:
            parent._modules[name] = child


def dequantized_linear_problem(lin: LinearLike) -> str:
    """What a 4-bit child's GEMM computes, checked once on random float32 tokens: bitsandbytes' ``matmul_4bit``
    (what ``Linear4bit.forward``, its class's own, calls) against ``F.linear`` with the weight dequantized. The
    weight is read whole (an FSDP2 shard gathered; ZeRO-3 gathered it for the probe). "" if it matches, else
    what differs."""
    m = lin.weight.owner
    problem = dequantizable(m)
    if problem:
        return f"cannot be dequantized: {problem}"
    state = quant_state_of(m)
    packed = m.weight.detach()
    packed = whole_tensor(packed) if is_dtensor(packed) else packed
    device = state.absmax.device
    tokens = torch.randn(PROBE_TOKENS, lin.in_features, device=device,
                         generator=torch.Generator(device=device).manual_seed(3))
    bias = None if getattr(m, "bias", None) is None else m.bias.detach().float()
    bias = whole_tensor(bias) if bias is not None and is_dtensor(bias) else bias
    with torch.no_grad(), exact_float32():
        got = matmul_4bit(tokens, packed, state, bias)
        want = F.linear(tokens, dequantize(packed, state, torch.float32), bias)
    err = rel_max_err(got, want)
    if err > PROBE_RTOL:
        return f"does not compute F.linear with its dequantized weight here (max relative error {err:.1e})"
    return ""


def probe_unavailable(module: nn.Module, params: Sequence[torch.Tensor], linears: Sequence[LinearLike]) -> str:
    """Why the probe cannot compute with these parameters outside the wrapper's forward ("" if it can)."""
    if any(p.device.type == "meta" for p in params):
        return "its parameters are on the meta device"
    if any(is_dtensor(p) for p in params) and fsdp2_units_below(module):
        return "FSDP2 units inside it own its parameters"
    if any(not isinstance(p, nn.Parameter) for p in params):
        return "its parameters are views of an FSDP1 flat parameter"
    for lin in linears:
        shape = (lin.in_features, lin.out_features) if lin.transposed else (lin.out_features, lin.in_features)
        if lin.quant is None and tuple(lin.weight.get().shape) != shape:
            return "its parameters are shards (FSDP1 with use_orig_params=True)"
    return ""
