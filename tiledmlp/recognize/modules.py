"""Which modules ``enable_tiling`` tiles, and with which form: :func:`recognize` (one module: a registered type, a MoE
block or its experts, a normalization layer, a LoRA-adapted projection, an MLP), :func:`register_mlp` (types tiled
with the generic form on request) and :func:`param_slots` (where a module's parameters are registered). Composed by
``tiledmlp.patching.planning``, which plans one ``enable_tiling`` call. Cost: the probes of ``mlp``, ``moe`` and
``norms`` (a few small forwards per candidate module, once per plan)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from torch import nn

from ..core.logs import warn_once
from ..distributed.deepspeed import gathered
from ..distributed.detect import is_fsdp1_wrapper
from ..forms.base import Slot
from ..forms.kind import Kind
from .candidates import Recognized, hidden_sizes, linear_like, registered, slot_index
from .mlp import recognize_mlp
from .moe import experts_interface, recognize_experts
from .norms import recognize_norm
from .probe import Probe, probe_unavailable
from .projections import recognize_projection

__all__ = ["recognize", "register_mlp", "param_slots", "check_per_token"]

_REGISTERED: list[type] = []


def register_mlp(module_type: type) -> type:
    """Tile every instance of ``module_type`` (any per-token module) with the generic form.

    Usable as a decorator. The module's forward must map ``[..., tokens, hidden]`` to outputs whose
    leading dims are the tokens' (each token computed independently of the others): ``enable_tiling`` checks it
    with the recognition probe (:func:`check_per_token`) and refuses a module that mixes tokens.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_mlp takes an nn.Module subclass, got {module_type!r}")
    if module_type not in _REGISTERED:
        _REGISTERED.append(module_type)
    return module_type


def param_slots(module: nn.Module) -> list[Slot]:
    """Every parameter slot in ``module``'s subtree (where the parameter is registered).

    FSDP1 flat parameters are left out: the module computes with views of them, read through the
    original parameters' slots (see :func:`_flatparam_slots`).
    """
    return [
        Slot(owner, pname)
        for _, owner in module.named_modules()
        for pname, p in owner._parameters.items()
        if p is not None and not getattr(p, "_is_flat_param", False)
    ]


def _flatparam_slots(module: nn.Module, root: nn.Module) -> list[Slot]:
    """FSDP1 with flat parameters: the original parameters' (module, name) inside ``module``.

    FSDP1 registers a flat parameter on the module it wraps — often an ancestor of the MLP (the
    decoder layer, the root) — so the flat parameters are searched from ``root``.
    """
    inside = {id(m) for m in module.modules()}
    return [
        Slot(info.module, info.param_name)
        for p in root.parameters()
        for info in getattr(p, "_param_infos", ())
        if id(info.module) in inside
    ]


def check_per_token(module: nn.Module, forward: Callable[..., Any], slots: Sequence[Slot]) -> None:
    """A registered module (``register_mlp``, ``mlp_types``) is per-token, as tiling needs: its forward on the probe's
    tokens (``recognize.probe``), at the first width it takes — the widths its Linear-like children chain, read, or
    its parameters have — must give each token's outputs whatever the other tokens are. ``ValueError`` when it mixes
    them (tiled, it would compute something else, silently); where the probe cannot run (no width the forward
    takes, parameters on the meta device or sharded, a forward that needs more than hidden states), said once and
    taken on trust."""
    params = [s.get() for s in slots]
    with gathered(params):  # ZeRO-3: whole parameters while the probe runs (a collective, as for an MLP's probe)
        why = _per_token_unchecked(module, forward, slots)
    if why:
        warn_once(("registered unchecked", type(module).__name__, why), "%s is registered for tiling (register_mlp "
                  "or mlp_types) and is tiled as such, but the probe could not check that it is per-token: %s",
                  type(module).__name__, why)


def _per_token_unchecked(module: nn.Module, forward: Callable[..., Any], slots: Sequence[Slot]) -> str:
    """:func:`check_per_token`'s probe: "" when the module is per-token, why it could not tell otherwise."""
    linears = [lin for lin in (linear_like(n, c) for n, c in module.named_children()) if lin is not None]
    where = {(id(s.owner), s.name): i for i, s in enumerate(slots)}
    params = [s.get() for s in slots]
    unavailable = probe_unavailable(module, params, linears) if params else "it has no parameters to size a probe by"
    if unavailable:
        return unavailable
    widths = [*hidden_sizes(linears), *(lin.in_features for lin in linears), *(d for p in params for d in p.shape)]
    slotted = [lin for lin in linears if registered(lin, where)]
    projections = [(lin, slot_index(lin.weight, where), None if lin.bias is None else slot_index(lin.bias, where))
                   for lin in slotted]
    probe = Probe(forward, module, slots, projections=projections)
    failure: Optional[Exception] = None
    for width in dict.fromkeys(widths):
        probe.tokens(width, next((lin for lin in slotted if lin.in_features == width), None), where)
        try:
            mixes = probe.mixes_tokens()
        except Exception as exc:  # not its width, or a forward that needs more than hidden states
            failure = exc
            continue
        if mixes:
            raise ValueError(
                f"{type(module).__name__} is registered for tiling (register_mlp or mlp_types), but its forward "
                "mixes tokens: on probe tokens, changing some of them changed the outputs of others (or an output "
                "does not lead with the tokens). Tiling computes token shards apart, so it would compute something "
                "else, silently. Register only per-token modules (drop it from mlp_types or register_mlp), or call "
                "it untiled.")
        return ""
    if failure is None:
        return "its parameters have no dimension to size the probe's tokens by"
    return f"its forward failed on probe tokens of every width tried ({type(failure).__name__}: {failure})"


def _is_moe(module: nn.Module) -> bool:
    return isinstance(getattr(module, "experts", None), nn.Module) and any(
        isinstance(getattr(module, n, None), nn.Module) for n in ("gate", "router"))


def recognize(module: nn.Module, forward_of: Callable[[nn.Module], Callable[..., Any]],
              extra_types: tuple[type, ...] = (), include_moe: bool = True, form: str = "auto",
              root: Optional[nn.Module] = None, experts_seen: Optional[dict[int, Recognized]] = None,
              norms: bool = False, projections: bool = False) -> Optional[Recognized]:
    """What tiling ``module`` (inside ``root``, default itself) means, or None if it is not a
    recognized MLP block (or, with ``norms``, normalization layer; with ``projections``, LoRA-adapted
    projection). A MoE block with ``include_moe=False`` is
    ``Kind.EXCLUDED``: neither it nor anything inside it (its experts) is tiled. ``experts_seen``: experts modules a
    MoE block's recognition already probed (by ``id``), so that a later call for the experts module itself does
    not probe again. ``forward_of(m)``: the forward ``m`` computes with when not tiled (the one the probes call;
    ``tiledmlp.patching`` passes the one a tiled module had before)."""
    experts_seen = {} if experts_seen is None else experts_seen
    if is_fsdp1_wrapper(module):
        # FSDP1 forwards attribute reads to the module it wraps, so it looks like that module; the
        # wrapped module is tiled instead (tiling the wrapper would gather parameters per shard).
        return None
    slots = param_slots(module) or _flatparam_slots(module, root if root is not None else module)
    if isinstance(module, tuple(_REGISTERED) + tuple(extra_types)):
        check_per_token(module, forward_of(module), slots)
        return Recognized(Kind.GENERIC, tuple(slots), reason="registered (register_mlp or mlp_types): generic by request")
    if _is_moe(module):
        if not include_moe:
            return Recognized(Kind.EXCLUDED, tuple(slots))
        experts = module.experts
        if form == "auto" and experts_interface(experts, forward_of(experts)):
            rec = experts_seen[id(experts)] = recognize_experts(experts, forward_of(experts),
                                                                param_slots(experts))
            if rec.kind == Kind.MOE:
                return None  # the block runs as is; its experts (and a shared expert) are recognized below
            reason = f"its experts ({type(experts).__name__}) cannot take the MoE form: {rec.reason}"
        elif form == "auto":
            reason = (f"its experts ({type(experts).__name__}) do not have the experts interface (two 3-D expert "
                      "weights, forward(hidden_states, top_k_index, top_k_weights))")
        else:
            reason = "form='generic' was asked for"
        return Recognized(Kind.GENERIC, tuple(slots), reason=f"MoE block: {reason}; the whole block, router included, "
                          "is recomputed per shard", warn=form == "auto", moe_block=True)
    forward = forward_of(module)
    if norms:
        rec = recognize_norm(module, forward, slots)
        if rec is not None:
            return rec
    if projections:
        rec = recognize_projection(module, slots)
        if rec is not None:
            return rec
    if form == "auto" and experts_interface(module, forward):
        rec = experts_seen.pop(id(module), None) or recognize_experts(module, forward, slots)
        return rec if rec.kind == Kind.MOE else None  # outside a MoE block, experts are tiled by the MoE form only
    return recognize_mlp(module, forward, slots, fast=form == "auto")
