"""LoRA adapters in the fast forms: ``y = x @ W.T + b + s * (x @ A.T) @ B.T``.

[Note: what a LoRA-wrapped projection computes, and when the fast form may compute it]
A peft LoRA linear (``peft.tuners.lora.layer.Linear``) in its plain state — one active adapter, not
merged, adapters enabled, no adapter dropout, no variant (DoRA, ...), no bias on ``B`` — computes
``base(x) + B(A(x.to(A.dtype))) * scaling``, cast back to the base output's dtype. The fast forms
compute exactly that per shard: each wrapped projection's :class:`tiledmlp.forms.mlp.Proj` carries a
:class:`LowRank` whose ``A`` and ``B`` are explicit inputs of the tiled call like the base weights,
so the adapters' gradients are summed over shards and handed to autograd once, under every strategy.
The recognition probe checks the adapter's computation too, with random ``A`` and ``B`` (peft
initializes ``B`` to zero, which would hide it).

Cost per shard of ``rows`` tokens, rank ``r``: forward ``z = x @ A.T`` (recomputed in backward, ``rows
x r``) and ``(z @ B.T) * s``; backward ``dB += d.T @ (s z)``, ``dz = s d @ B``, ``dA += dz.T @ x``, ``dx
+= dz @ A`` — ``O(rows * r * (in + out))`` FLOP beside the base GEMMs' ``O(rows * in * out)``. Adapter
weights in another dtype than the base (peft keeps them in float32 for a bf16 model) are computed in
theirs, as peft does; what is cast or multiplied at full width is done ``ADAPTER_BLOCK`` columns at a
time, so the extra scratch is at most ``rows * ADAPTER_BLOCK`` elements of the adapter's dtype.

A layer in any other state takes the generic form, which runs peft's own forward. The state is read
again at every call (:func:`changed_adapters`): a layer merged, disabled (``with
model.disable_adapter()``), switched to another adapter or rescaled after ``enable_tiling`` makes that
call generic — exact — with a warning once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..core.accumulate import GradAccumulator, addmm_
from ..core.sharding import chunk_bounds
from .base import Slot, is_plain_linear, parametrized

__all__ = ["ADAPTER_BLOCK", "Adapter", "LowRank", "changed_adapters", "is_peft_lora", "lora_adapter"]

ADAPTER_BLOCK = 2048  # columns cast or multiplied at a time at full width (multiples of 1024: aligned blocks)


def is_peft_lora(m: nn.Module) -> bool:
    """A peft LoRA linear layer (``base_layer`` wrapped, adapters in ``lora_A``/``lora_B``)."""
    return isinstance(getattr(m, "base_layer", None), nn.Module) and hasattr(m, "lora_A")


@dataclass(frozen=True)
class Adapter:
    """The one active adapter of a peft LoRA layer: where its ``A`` and ``B`` weights live and its scale;
    ``child``: the layer's name in the MLP (for messages)."""

    layer: nn.Module
    name: str
    a: Slot
    b: Slot
    scale: float
    child: str = ""


#: peft's LoRA layers whose plain state the fast forms compute: ``lora.Linear``, and the one around a bitsandbytes
#: 4-bit base layer (which casts the adapter's output to the base output's dtype before adding it: the same sum
#: within one rounding)
_COMPUTED = {("peft.tuners.lora.layer", "Linear"), ("peft.tuners.lora.bnb", "Linear4bit")}


def lora_adapter(m: nn.Module) -> Union[Adapter, str]:
    """The adapter a fast form can compute for the peft LoRA layer ``m``, or why there is none."""
    cls = type(m)
    if (cls.__module__, cls.__name__) not in _COMPUTED:
        return f"a {cls.__name__} LoRA layer (the fast forms compute peft's lora.Linear and lora's Linear4bit)"
    if m.merged:
        return "its adapters are merged into the base weight"
    if m.disable_adapters:
        return "its adapters are disabled"
    active = [a for a in m.active_adapters if a in m.lora_A]
    if len(active) != 1:
        return f"{len(active)} adapters are active"
    name = active[0]
    if name in getattr(m, "lora_variant", {}) or getattr(m, "use_dora", {}).get(name):
        return "it is a LoRA variant (DoRA or another)"
    a, b, dropout = m.lora_A[name], m.lora_B[name], m.lora_dropout[name]
    if not (is_plain_linear(a) and is_plain_linear(b)) or a.bias is not None or b.bias is not None:
        return "its adapter's A or B is not a bias-free nn.Linear"
    if parametrized(a) or parametrized(b):
        return f"its adapter's A or B is {parametrized(a) or parametrized(b)}"
    if not (isinstance(dropout, nn.Identity) or (type(dropout) is nn.Dropout and dropout.p == 0)):
        return f"its adapter applies dropout ({dropout}); set lora_dropout=0 for the fast form"
    scale = m.scaling[name]
    if not isinstance(scale, (int, float)):
        return f"its scaling is a {type(scale).__name__}, not a number"
    return Adapter(m, name, Slot(a, "weight"), Slot(b, "weight"), float(scale))


def changed_adapters(adapters: Sequence[Adapter]) -> list[str]:
    """What changed since recognition in the layers of ``adapters`` (empty: the fast form still computes
    what they do)."""
    changed = []
    for rec in adapters:
        now = lora_adapter(rec.layer)
        if isinstance(now, str):
            changed.append(f"{rec.child}: {now}")
        elif (now.name, now.a.owner, now.b.owner, now.scale) != (rec.name, rec.a.owner, rec.b.owner, rec.scale):
            changed.append(f"{rec.child}: adapter {now.name!r} with scale {now.scale} is active instead of "
                           f"{rec.name!r} with scale {rec.scale}")
    return changed


# ----------------------------------------------------------------------------------------------
# The computation


def _blocks(width: int) -> list[tuple[int, int]]:
    return chunk_bounds(width, -(-width // ADAPTER_BLOCK), min(1024, ADAPTER_BLOCK))


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _shift(rows: slice, lo: int, hi: int) -> slice:
    base = rows.start or 0
    return slice(base + lo, base + hi)


@dataclass(frozen=True)
class LowRank:
    """A projection's LoRA adapter over the tiled function's parameter tensors: ``a`` indexes ``A``
    (``[r, in]``), ``b`` indexes ``B`` (``[out, r]``); adds ``s * (x @ A.T) @ B.T``."""

    a: int
    b: int
    scale: float

    def remap(self, index: Sequence[int]) -> "LowRank":
        return replace(self, a=index[self.a], b=index[self.b])

    def dtype(self, x: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.dtype:
        """The adapter's compute dtype: autocast's where it is on, else ``A``'s (peft casts the input to it)."""
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return params[self.a].dtype

    # -- forward -----------------------------------------------------------------------------------

    def project(self, x: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """``z = x @ A.T`` (``rows x r``, the adapter's dtype)."""
        a, dt = params[self.a], self.dtype(x, params)
        if x.dtype == dt or torch.is_autocast_enabled(x.device.type):  # autocast casts, one GEMM rounds once
            return F.linear(x, a)
        z = None  # the input cast to the adapter's (wider) dtype a column block at a time
        for lo, hi in _blocks(x.shape[1]):
            part = F.linear(x[:, lo:hi].to(dt), _as(a[:, lo:hi], dt))
            z = part if z is None else z.add_(part)
        return z

    def add_(self, y: torch.Tensor, z: torch.Tensor, params: Sequence[torch.Tensor], rows: slice = slice(None)) -> None:
        """``y += (z @ B[rows].T) * s`` in place, rounded to ``y``'s dtype once (peft's ``result + lora * s``)."""
        b = _as(params[self.b][rows], z.dtype)
        for lo, hi in _blocks(y.shape[1]):
            y[:, lo:hi].add_(F.linear(z, b[lo:hi]).mul_(self.scale))

    # -- backward of an input-side projection (gate, up, fused gate/up) -----------------------------

    def plan_input(self, grads: GradAccumulator, width: int) -> None:
        """Declare ``A``'s column blocks (the projection's ``width`` input features) before its first add."""
        if grads.needs[self.a]:
            grads.plan_columns(self.a, _blocks(width))

    def output_grads(self, grads: GradAccumulator, d_out: torch.Tensor, z: torch.Tensor,
                     params: Sequence[torch.Tensor], rows: slice, dz: torch.Tensor) -> None:
        """For output features ``rows`` with gradient ``d_out``: ``dB[rows] += d_out.T @ (s z)``, and
        ``dz += d_out @ B[rows]`` (``dz``: float32, scaled by :meth:`input_grads`)."""
        b = params[self.b]
        zs = z * self.scale
        for lo, hi in _blocks(d_out.shape[1]):
            d = _as(d_out[:, lo:hi], z.dtype)
            if grads.needs[self.b]:
                grads.addmm(self.b, d.t(), zs, rows=_shift(rows, lo, hi))
            addmm_(dz, d, _as(b[_shift(rows, lo, hi)], z.dtype))

    def input_grads(self, grads: GradAccumulator, dz: torch.Tensor, x: torch.Tensor,
                    params: Sequence[torch.Tensor], dx: Optional[torch.Tensor]) -> None:
        """Once per shard, from the summed ``dz``: ``dA += s dz.T @ x`` and ``dx += s dz @ A``."""
        a = params[self.a]
        dz = (dz * self.scale).to(self.dtype(x, params))
        for lo, hi in _blocks(x.shape[1]):
            if grads.needs[self.a]:
                grads.addmm(self.a, dz.t(), _as(x[:, lo:hi], dz.dtype), cols=slice(lo, hi))
            if dx is not None:
                dx[:, lo:hi].add_(torch.mm(dz, _as(a[:, lo:hi], dz.dtype)))

    # -- backward of the down projection (its input ``h`` exists one column block at a time) ---------

    def grad_through(self, g: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """``s * g @ B`` (``rows x r``): the adapter's gradient path back to ``h`` goes through ``A``."""
        b, dt = params[self.b], self.dtype(g, params)
        gb = torch.zeros(g.shape[0], b.shape[1], dtype=torch.float32, device=g.device)
        for lo, hi in _blocks(g.shape[1]):
            addmm_(gb, _as(g[:, lo:hi], dt), _as(b[lo:hi], dt))
        return gb.mul_(self.scale).to(dt)

    def add_dh_(self, dh: torch.Tensor, gb: torch.Tensor, params: Sequence[torch.Tensor], cols: slice) -> None:
        """``dh += gb @ A[:, cols]`` (``dh``: the columns ``cols`` of ``h``'s gradient)."""
        a = params[self.a][:, cols]
        for lo, hi in _blocks(dh.shape[1]):
            dh[:, lo:hi].add_(torch.mm(gb, _as(a[:, lo:hi], gb.dtype)))

    def h_block_grads(self, grads: GradAccumulator, gb: torch.Tensor, h: torch.Tensor,
                      params: Sequence[torch.Tensor], cols: slice, z: torch.Tensor) -> None:
        """For ``h``'s columns ``cols``: ``dA[:, cols] += gb.T @ h``, and ``z += h @ A[:, cols].T`` (float32, for
        ``dB``: only when ``B`` wants a gradient)."""
        a = params[self.a]
        for lo, hi in _blocks(h.shape[1]):
            part = _shift(cols, lo, hi)
            hb = _as(h[:, lo:hi], gb.dtype)
            if grads.needs[self.a]:
                grads.addmm(self.a, gb.t(), hb, cols=part)
            if grads.needs[self.b]:
                addmm_(z, hb, _as(a[:, part], gb.dtype).t())

    def down_grads(self, grads: GradAccumulator, g: torch.Tensor, z: torch.Tensor,
                   params: Sequence[torch.Tensor]) -> None:
        """Once per shard, from ``z = h @ A.T`` summed over ``h``'s blocks: ``dB += g.T @ (s z)``."""
        if not grads.needs[self.b]:
            return
        dt = self.dtype(g, params)
        zs = (z * self.scale).to(dt)
        for lo, hi in _blocks(g.shape[1]):
            grads.addmm(self.b, _as(g[:, lo:hi], dt).t(), zs, rows=slice(lo, hi))

    def plan_down(self, grads: GradAccumulator, dh_bounds: Sequence[tuple[int, int]]) -> None:
        """Declare ``A``'s column blocks for the down projection (sub-blocks of the ``dh`` blocks)."""
        if grads.needs[self.a]:
            grads.plan_columns(self.a, [(start + lo, start + hi) for start, stop in dh_bounds
                                        for lo, hi in _blocks(stop - start)])
