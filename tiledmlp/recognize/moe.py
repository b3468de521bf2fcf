"""Recognize a MoE layer's experts by interface and computation, for the MoE form (``forms/moe.py``).

[Note: what makes an experts module]
The interface transformers 5 gives every MoE family (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss,
Llama-4 text, GLM-4-MoE, ...): ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``
over two 3-D expert weights (``[E, out, in]``, or ``[E, in, out]`` when transposed) and optional ``[E, out]``
biases, whatever ``experts_implementation`` dispatches to. Names do not decide anything: every assignment
of the two weights to the up and down projections, both storage orders and every bias assignment that the
shapes allow is a candidate, with each fused activation (``act(first half) * second half``, or ``act(h)``
ungated) and, when the module has one, its own gate function (``_apply_gate``: gpt-oss's clamped,
interleaved SwiGLU; ``act_fn`` for ungated experts). The probe runs the module's own forward on random
tokens and routing (every expert hit) in float32 and keeps the candidate that reproduces it within
``PROBE_RTOL``, preferring a fused activation; it also checks the forward is per token and the same in
training mode. What the form does not compute (a post-expert norm, expert parallelism's sentinel
experts, LoRA adapters on the experts, submodules with parameters) keeps the whole MoE block on the
generic form, with the reason.
"""

from __future__ import annotations

import inspect
import itertools
import math
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..distributed.deepspeed import full_shape, gathered
from ..distributed.detect import is_dtensor, whole_tensor
from ..forms.base import Slot
from ..forms.kind import Kind
from ..forms.moe import GATE_ATTRS, ExpertsLayout, MoEForm
from .candidates import Recognized
from .probe import PROBE_ACTIVATIONS, PROBE_RTOL, Probe, exact_float32, probe_unavailable, rel_max_err

__all__ = ["experts_interface", "recognize_experts"]

_PROBE_TOP_K = 2
_PRE_ACTIVATION_STD = 2.0


def _positional(forward: Callable[..., Any]) -> list[str]:
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _weights(module: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """Names of the module's own 3-D and 2-D parameters, and of everything else it holds (parameters of
    other ranks or in submodules, buffers)."""
    own = {n: len(full_shape(p)) for n, p in module._parameters.items() if p is not None}
    three = [n for n, dim in own.items() if dim == 3]
    two = [n for n, dim in own.items() if dim == 2]
    other = [n for n, dim in own.items() if dim not in (2, 3)]
    other += [f"{mn}.{pn}" for mn, m in module.named_modules() if m is not module
              for pn, p in m._parameters.items() if p is not None]
    other += [n for n, _ in module.named_buffers()]
    return three, two, other


def experts_interface(module: nn.Module, forward: Callable[..., Any]) -> bool:
    """Whether ``module`` looks like a MoE experts module: two 3-D weights with the same number of experts
    and a forward taking ``(hidden_states, top_k_index, top_k_weights)``."""
    three, _, _ = _weights(module)
    if len(three) != 2 or len(_positional(forward)) < 3:
        return False
    a, b = (_shape(module, n) for n in three)
    return a[0] == b[0]


def _shape(module: nn.Module, name: str) -> tuple[int, ...]:
    """A parameter's whole shape, also while ZeRO-3 keeps it partitioned."""
    return tuple(full_shape(Slot(module, name).get()))


def _layouts(module: nn.Module, index: dict[str, int]) -> list[tuple[str, ExpertsLayout]]:
    """Every layout the shapes allow (activation left None), with a description."""
    three, two, _ = _weights(module)
    shapes = {n: _shape(module, n) for n in three + two}
    out = []
    for up, down in itertools.permutations(three):
        for transposed in (False, True):
            e, *up_dims = shapes[up]
            _, *down_dims = shapes[down]
            (hidden, width), (inter, hidden_out) = ((up_dims, down_dims) if transposed
                                                    else (up_dims[::-1], down_dims[::-1]))
            if hidden != hidden_out or width not in (inter, 2 * inter):
                continue
            gated = width == 2 * inter
            up_biases = [n for n in two if shapes[n] == (e, width)]
            down_biases = [n for n in two if shapes[n] == (e, hidden)]
            for ub, db in itertools.product(up_biases or [None], down_biases or [None]):
                if ub is not None and ub == db or len([n for n in (ub, db) if n]) != len(two):
                    continue
                lay = ExpertsLayout(index[up], index[down], gated, transposed, None,
                                    None if ub is None else index[ub], None if db is None else index[db])
                words = f"{up} ({'[E, in, out]' if transposed else '[E, out, in]'}) -> {{act}} -> {down}"
                out.append((words + (f", biases {ub}, {db}" if ub or db else ""), lay))
    return out


class _ExpertsProbe:
    """The module's forward on probe tokens and routing, with float32 copies of its weights (the dense
    probe's, ``tiledmlp.recognize.probe.Probe``)."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any], slots: Sequence[Slot], num_experts: int,
                 hidden: int, up_weight: torch.Tensor) -> None:
        self.probe = Probe(forward, module, slots)
        dtype = self.probe.proxies[0].dtype
        device = self.probe.proxies[0].device
        gen = torch.Generator(device=device).manual_seed(0)
        k = min(_PROBE_TOP_K, num_experts)
        tokens = max(16, math.ceil(2 * num_experts / k))  # every expert gets rows
        self.index = torch.rand(tokens, num_experts, generator=gen, device=device).argsort(-1)[:, :k]
        self.weights = torch.rand(tokens, k, generator=gen, device=device, dtype=dtype) + 0.5
        x = torch.randn(tokens, hidden, generator=gen, device=device, dtype=dtype)
        rms = up_weight.detach().float().pow(2).mean().sqrt().item() if up_weight.numel() else 0.0
        self.x = x * (_PRE_ACTIVATION_STD / max(rms * math.sqrt(hidden), 1e-12))

    def run(self, rows: slice = slice(None), training: bool = False) -> Any:
        return self.probe.run(self.x[rows], self.index[rows], self.weights[rows], training=training)

    def candidate(self, layout: ExpertsLayout, gate_fn: Optional[Callable[..., Any]]) -> torch.Tensor:
        with torch.no_grad(), exact_float32():
            form = MoEForm(layout.remap(self.probe.unique_index), gate_fn)
            return form.forward_shard(self.x, self.probe.unique, side=(self.index, self.weights))[0]


def _unsupported(module: nn.Module, params: Sequence[torch.Tensor]) -> str:
    """Why the MoE form cannot compute this experts module ("" if it may)."""
    if getattr(module, "has_post_expert_norm", False):
        return "it normalizes each expert's output (has_post_expert_norm), which the MoE form does not compute"
    if getattr(module, "_is_expert_parallel", False):
        return "it is expert parallel (routing reaches experts of other ranks), which the MoE form does not compute"
    _, _, other = _weights(module)
    if other:
        return (f"it holds parameters or buffers besides its expert weights and biases ({', '.join(other[:4])}: "
                "LoRA adapters or a learned scale), which the MoE form does not compute")
    unavailable = probe_unavailable(module, params, ())  # no Linear children: the expert weights are its own
    if unavailable:
        return f"the probe could not run ({unavailable}); enable tiling before sharding the model"
    return ""


def recognize_experts(module: nn.Module, forward: Callable[..., Any], slots: Sequence[Slot]) -> Recognized:
    """The MoE form for an experts module (kind ``Kind.MOE``, layout an :class:`ExpertsLayout` over ``slots``
    with ``computes`` saying what it computes), or ``Kind.GENERIC`` with the reason it cannot be used."""
    with gathered([s.get() for s in slots]):  # ZeRO-3: whole weights while the probe runs
        return _recognize_experts(module, forward, slots)


def _recognize_experts(module: nn.Module, forward: Callable[..., Any], slots: Sequence[Slot]) -> Recognized:
    def generic(reason: str) -> Recognized:
        return Recognized(Kind.GENERIC, tuple(slots), reason=reason, warn=True)

    params = [s.get() for s in slots]
    reason = _unsupported(module, params)
    if reason:
        return generic(reason)
    where = {s.name: i for i, s in enumerate(slots) if s.owner is module}
    layouts = _layouts(module, where)
    if not layouts:
        return generic("its two 3-D weights do not chain hidden -> (2 x) intermediate -> hidden in either storage "
                       "order")
    full = [whole_tensor(p) if is_dtensor(p) else p for p in params]
    num_experts = full[layouts[0][1].up].shape[0]
    failure: Optional[Exception] = None
    for hidden in dict.fromkeys(lay.w_up(full).shape[1] for _, lay in layouts):  # the widths the shapes allow
        probe = _ExpertsProbe(module, forward, slots, num_experts, hidden,
                              next(full[lay.up] for _, lay in layouts if lay.w_up(full).shape[1] == hidden))
        try:
            ref = probe.run()
        except Exception as exc:  # noqa: BLE001 - the other width, or the reason
            failure = exc
            continue
        break
    else:
        return generic(f"its forward failed on probe tokens ({type(failure).__name__}: {failure})")
    layouts = [(words, lay) for words, lay in layouts if lay.w_up(full).shape[1] == hidden]
    try:
        half = probe.x.shape[0] // 2
        parts = torch.cat([probe.run(slice(None, half)), probe.run(slice(half, None))])
        train = probe.run(training=True)
    except Exception as exc:  # noqa: BLE001 - whatever the forward raises is the reason
        return generic(f"its forward failed on probe tokens ({type(exc).__name__}: {exc})")
    if not isinstance(ref, torch.Tensor) or ref.shape != probe.x.shape:
        return generic("its forward does not map [tokens, hidden] states to [tokens, hidden] states")
    if rel_max_err(parts, ref) > PROBE_RTOL:
        return generic("its forward is not per token (two halves of the probe tokens computed apart differ)")
    if not isinstance(train, torch.Tensor) or rel_max_err(train, ref) > PROBE_RTOL:
        return generic("its forward computes differently in training mode")
    kernel, own = [], []
    for words, lay in layouts:
        for act in PROBE_ACTIVATIONS:
            candidate = ExpertsLayout(lay.up, lay.down, lay.gated, lay.transposed, act, lay.up_bias, lay.down_bias)
            if rel_max_err(probe.candidate(candidate, None), ref) <= PROBE_RTOL:
                kernel.append((words.format(act=f"{act} GLU" if lay.gated else act), candidate))
        gate_fn = getattr(module, GATE_ATTRS[lay.gated], None)
        if callable(gate_fn) and rel_max_err(probe.candidate(lay, gate_fn), ref) <= PROBE_RTOL:
            own.append((words.format(act=f"its {GATE_ATTRS[lay.gated]}"), lay))
    matches = kernel or own
    if len(matches) == 1:
        words, lay = matches[0]
        return Recognized(Kind.MOE, tuple(slots), lay, computes=f"experts: {words}, routed once")
    if matches:
        return generic("the probe matched several expert layouts (" + "; ".join(w for w, _ in matches) + ")")
    return generic("its forward matches no expert layout: x -> up[e] -> GLU or activation (fused, or its own "
                   f"{'/'.join(GATE_ATTRS.values())}) -> down[e], weighted by the routing and summed over the top k")
