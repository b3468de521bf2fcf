"""The entry points of host offload (``host.py`` has the mechanics and their notes): a drop-in
:func:`checkpoint` for custom models, and Hugging Face's per-layer checkpoint function replaced on the layers of
``enable_tiling(model, offload="cpu")`` (:func:`install_offload`, undone by :func:`uninstall_offload`). One
:class:`~tiledmlp.offload.host.HostOffload` per device serves every model of the process.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional, Sequence

import torch

from ..core.compat import checkpointing_call, checkpointing_method
from ..core.logs import counted, warn_once
from ..core.places import Place
from ..core.regions import KEEPABLE, CheckpointRegion
from .chain import LayerCall, recompute_run, rng_state
from .host import HostOffload

log = logging.getLogger("tiledmlp")

__all__ = ["OFFLOAD_TARGETS", "PLACES", "SMALL", "LayerPlacement", "OffloadingCheckpointFunc", "checkpoint",
           "checkpointed_layers", "install_offload", "uninstall_offload", "offloaded_layers", "offload_problems",
           "offloader_for", "layer_placement", "checkpointing_modules", "pinned_bytes"]

OFFLOAD_TARGETS = ("cpu", "auto")
_SAVED_ATTR = "_tiledmlp_offload_saved"
_HOOK_ATTR = "_tiledmlp_offload_hook"


_OFFLOADERS: dict[torch.device, HostOffload] = {}


def _one_device(device: torch.device) -> torch.device:
    """``device`` with its index (``"cuda"`` is the current CUDA device): one offloader per device, however named."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def offloader_for(device: torch.device) -> HostOffload:
    """The process's offloader for ``device`` (its host buffers are shared by every model on it)."""
    device = _one_device(device)
    offloader = _OFFLOADERS.get(device)
    if offloader is None:
        offloader = _OFFLOADERS[device] = HostOffload(device)
    return offloader


def pinned_bytes(device: torch.device) -> int:
    """Host bytes the process's offloader for ``device`` holds in its pool (reused by later steps; 0 if none)."""
    offloader = _OFFLOADERS.get(_one_device(device))
    return offloader.stats["host_bytes"] if offloader is not None else 0


def _check_target(offload: Optional[str]) -> None:
    if offload is not None and offload not in OFFLOAD_TARGETS:
        raise ValueError(f"offload={offload!r} is not supported; use one of {list(OFFLOAD_TARGETS)} or None")


def _device_of(args: tuple) -> Optional[torch.device]:
    return next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)


def checkpoint(function: Callable[..., Any], *args: Any, offload: Optional[str] = "cpu", use_reentrant: bool = False,
               preserve_rng_state: bool = True, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)`` whose large tensor
    arguments wait for the recompute in host memory (``offload="cpu"``; None: plain checkpointing).

    The drop-in for custom models (Hugging Face models: ``enable_tiling(model, offload="cpu")``). Memory:
    the arguments' device copies are freed from the end of the region's forward to one region before its
    recompute; host memory holds them meanwhile. Communication: none.
    """
    _check_target(offload)
    if offload == "auto":
        raise ValueError("offload='auto' places the inputs of a model's checkpointed layers from its memory plan: pass "
                         "it to enable_tiling; tiledmlp.checkpoint takes offload='cpu' or None")
    if use_reentrant:
        raise ValueError("tiledmlp.checkpoint offloads the inputs of non-reentrant checkpointing only (reentrant "
                         "checkpointing saves them itself); call it with use_reentrant=False.")
    ckpt = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False,
                             preserve_rng_state=preserve_rng_state)
    device = _device_of(args)
    if offload is None or device is None:
        return ckpt(function, *args, **kwargs)
    return offloader_for(device).run(ckpt, function, *args, **kwargs)


PLACES = tuple(Place)  # in order: kept on the device, on the host, recomputed
SMALL = "small"  # a layer input under the offloader's threshold (host.MIN_BYTES): left where it is


class LayerPlacement:
    """Where the checkpointed layers of one model keep their inputs between forward and backward, one of
    :data:`PLACES` per layer in forward order (``tiledmlp.core.places.Place``: kept on the device as plain
    checkpointing keeps it, on the host with ``host.py``, or recomputed with ``chain.py``); and what each layer's
    forward keeps for its recompute (kinds of ``tiledmlp.core.regions.KEEPABLE``, run in a ``CheckpointRegion``).
    ``decide(nbytes)`` chooses both, ``(places, keeps)``, for a step whose layer input is ``nbytes``, at the step's
    first layer (None, ``offload="cpu"``: every layer on the host, nothing kept; ``offload="auto"``: the memory plan,
    which keeps its decisions). Executes a placement; never decides one."""

    def __init__(self, layers: int,
                 decide: Optional[Callable[[int], tuple[Sequence[str], Sequence[frozenset[str]]]]] = None) -> None:
        self.layers, self.decide = layers, decide
        self.places: tuple[str, ...] = (Place.HOST,) * layers
        self.keeps: tuple[frozenset[str], ...] = (frozenset(),) * layers
        self.previous: Optional[LayerCall] = None  # the step's last layer call (for a chain); never pickled
        self.moved: dict[int, str] = {}  # layer index -> why it is offloaded instead of recomputed
        # calls per place, the inputs a chain freed and rebuilt, the calls that kept something for their recompute
        # (tests, describe)
        self.stats = {**dict.fromkeys(PLACES, 0), "freed": 0, "rebuilt": 0, "kept": 0}
        # layer index -> where its input waited in the layer's last call needing a gradient, on any device: one of
        # PLACES, or SMALL (too small to move: left where it was, as plain checkpointing keeps it) (describe)
        self.last: dict[int, str] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "previous": None}

    def place(self, index: int, nbytes: int) -> str:
        if index == 0:
            self.previous = None  # a chain never reaches into another step
            if self.decide is not None:
                places, keeps = self.decide(nbytes)
                places, keeps = tuple(places), tuple(frozenset(k) for k in keeps)
                if (len(places) != self.layers or set(places) - set(PLACES) or places[:1] == (Place.RECOMPUTE,)
                        or len(keeps) != self.layers or set().union(*keeps) - set(KEEPABLE)):
                    raise ValueError(f"a placement gives each of the {self.layers} checkpointed layers one of "
                                     f"{PLACES}, the first not 'recompute' (nothing below it to recompute from), and "
                                     f"what it keeps for its recompute (of {KEEPABLE}); got {places}, {keeps}")
                self.places, self.keeps = places, keeps
        return self.places[index] if index < len(self.places) else Place.HOST

    def keeps_of(self, index: int) -> frozenset[str]:
        return self.keeps[index] if index < len(self.keeps) else frozenset()

    @property
    def offload(self) -> str:
        """The ``offload`` option this placement executes: ``"auto"`` (the memory plan decides), else ``"cpu"``."""
        return "cpu" if self.decide is None else "auto"

    @property
    def chains(self) -> bool:
        return Place.RECOMPUTE in self.places

    @property
    def on_host(self) -> int:
        """Layers of this step whose input goes to the host: what the offloader pins buffers for (a layer kept on
        the device or recomputed needs none)."""
        return sum(place == Place.HOST or i in self.moved for i, place in enumerate(self.places))


class OffloadingCheckpointFunc:
    """A layer's checkpoint function (Hugging Face's ``_gradient_checkpointing_func``, ``CheckpointWrapper``'s
    ``checkpoint_fn``: ``functools.partial(checkpoint, use_reentrant=False, ...)``) with the layer's input kept
    where its model's :class:`LayerPlacement` says: on the device, on the host (``HostOffload.run_region``), or
    nowhere (recomputed from the previous layer's, ``chain.recompute_run``); and the layer run in a
    ``CheckpointRegion`` that keeps what the placement says for its recompute."""

    __slots__ = ("original", "index", "placement")

    def __init__(self, original: Callable[..., Any], index: int, placement: LayerPlacement) -> None:
        self.original, self.index, self.placement = original, index, placement

    @property
    def layers(self) -> int:
        return self.placement.layers

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        device = _device_of(args)
        if device is None or not torch.is_grad_enabled():
            return self.original(function, *args, **kwargs)
        offloader = offloader_for(device)
        positions = [i for i, a in enumerate(args) if offloader.wants(a)]
        placement = self.placement
        if not positions:
            placement.last[self.index] = SMALL
            return self.original(function, *args, **kwargs)
        place = placement.place(self.index, sum(args[i].numel() * args[i].element_size() for i in positions))
        previous = placement.previous
        if place == Place.RECOMPUTE and (previous is None or len(positions) != 1
                                         or not previous.feeds(args[positions[0]])):
            place = Place.HOST
            if self.index not in placement.moved:
                placement.moved[self.index] = ("its input is not the previous checkpointed layer's output (the model "
                                               "changes the hidden states between layers)")
                warn_once(("recompute moved", self.index), "offload='auto': checkpointed layer %d is offloaded to the "
                          "host instead of recomputed: %s", self.index, placement.moved[self.index])
        placement.stats[place] += 1
        placement.last[self.index] = place
        rng = rng_state(device) if placement.chains else None
        present: Callable[[], None] = _nothing
        keeps = placement.keeps_of(self.index)
        placement.stats["kept"] += bool(keeps)
        # the checkpoint holds the region from the forward to the recompute (what it keeps lives as long)
        run = CheckpointRegion(function, keeps) if keeps else function
        if place == Place.GPU:
            out, given = self.original(run, *args, **kwargs), args
        elif place == Place.HOST:
            offloader.expect(placement.on_host)
            out, given, region = offloader.run_region(self.original, run, *args, **kwargs)
            present = region.present if region is not None else _nothing
        else:
            out, given, present = recompute_run(self.original, run, args, kwargs, positions[0], previous,
                                               placement.stats)
        placement.previous = (LayerCall.record(function, given, kwargs, out, rng, present) if placement.chains
                              else None)
        return out


def _nothing() -> None:
    return None


def _func_attr(module: torch.nn.Module) -> Optional[str]:
    """Where ``module`` keeps the checkpoint function it calls as ``fn(function, *args, **kwargs)``:
    Hugging Face's checkpointing layers (``_gradient_checkpointing_func``, while ``gradient_checkpointing``
    is on) and torch's ``CheckpointWrapper`` (``checkpoint_fn``; torchtitan's ``apply_ac``)."""
    if getattr(module, "gradient_checkpointing", False) is True and "_gradient_checkpointing_func" in module.__dict__:
        return "_gradient_checkpointing_func"
    if type(module).__name__ == "CheckpointWrapper" and "checkpoint_fn" in module.__dict__:
        return "checkpoint_fn"
    return None


def _original_func(module: torch.nn.Module) -> Any:
    attr = _func_attr(module)
    func = None if attr is None else module.__dict__[attr]
    return func.original if isinstance(func, OffloadingCheckpointFunc) else func


def checkpointing_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that checkpoint their calls (the decoder layers, in forward order), in any way."""
    flagged = [m for m in model.modules() if callable(_original_func(m))]
    # Transformers 5 checkpoints in each GradientCheckpointingLayer (the base model keeps a flag it does not
    # use); older modeling code calls the base model's function once per layer.
    hf_layers = [m for m in flagged if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)]
    return hf_layers + [m for m in flagged if _func_attr(m) == "checkpoint_fn"] if hf_layers else flagged


def checkpointed_layers(model: torch.nn.Module, offload: Optional[str]) -> list[torch.nn.Module]:
    """The modules whose checkpointed inputs ``offload`` moves (none for None); ValueError, naming the fix,
    when the model does not checkpoint or checkpoints reentrantly. Changes nothing."""
    _check_target(offload)
    if offload is None:
        return []
    layers = checkpointing_modules(model)
    if not layers:
        raise ValueError(
            f"offload={offload!r} moves checkpointed activations to the host, but no module of "
            f"{type(model).__name__} checkpoints: call {checkpointing_call(model)} before enable_tiling, or wrap "
            "the layers with torch's checkpoint_wrapper (torchtitan's apply_ac), or, in a custom model, use "
            "tiledmlp.checkpoint(fn, *args) where it calls torch.utils.checkpoint.checkpoint.")
    for m in layers:
        if _checkpoint_problem(m):
            raise ValueError(
                f"offload={offload!r} needs non-reentrant checkpointing (torch.utils.checkpoint with "
                f"use_reentrant=False), but {type(m).__name__} checkpoints with {_original_func(m)!r}: call "
                f"{checkpointing_call(model)}, or checkpoint_wrapper(..., "
                "checkpoint_impl=CheckpointImpl.NO_REENTRANT).")
    return layers


def _checkpoint_problem(module: torch.nn.Module) -> str:
    """Why ``module``'s inputs cannot be offloaded now ("" if they can: it checkpoints non-reentrantly)."""
    func = _original_func(module)
    if not callable(func):
        return "it no longer checkpoints (gradient checkpointing was disabled)"
    if not (isinstance(func, functools.partial) and func.func is torch.utils.checkpoint.checkpoint
            and func.keywords.get("use_reentrant") is False):
        return (f"it now checkpoints with {func!r}, not torch.utils.checkpoint with use_reentrant=False (call "
                f"{checkpointing_call(module)}, and no offload=True of transformers' own)")
    return ""


def _wrap(module: torch.nn.Module, index: int, placement: LayerPlacement) -> None:
    attr = _func_attr(module)
    original = module.__dict__[attr]
    module.__dict__[_SAVED_ATTR] = (attr, original)
    setattr(module, attr, OffloadingCheckpointFunc(original, index, placement))


class _KeepOffloading:
    """Forward pre-hook on the model ``enable_tiling`` was given: a layer whose checkpoint function was replaced
    since — ``Trainer(args=TrainingArguments(gradient_checkpointing=True))`` calls ``activation_checkpointing_enable``
    (``gradient_checkpointing_enable`` before transformers 5.23) when training starts — gets the offloading one again
    when the new one is non-reentrant torch checkpointing; otherwise its inputs stay on the device, said once and in
    ``describe()``. Holds the layers' names (copies and pickles of the model keep working)."""

    def __init__(self, names: list[str], placement: LayerPlacement) -> None:
        self.names, self.placement = names, placement
        self.problems: dict[str, str] = {}  # layer -> why its inputs are not offloaded now

    def __call__(self, model: torch.nn.Module, args: Any) -> None:
        wrapped, problems = [], {}
        for index, name in enumerate(self.names):
            layer = model.get_submodule(name)
            attr, _ = layer.__dict__[_SAVED_ATTR]
            if isinstance(layer.__dict__.get(attr), OffloadingCheckpointFunc):
                continue
            problem = _checkpoint_problem(layer)
            if problem:
                problems.setdefault(problem, []).append(name)
            else:
                _wrap(layer, index, self.placement)
                wrapped.append(name)
        offload = self.placement.offload
        if wrapped:
            log.info("offload=%r: the checkpoint function of %s was replaced since enable_tiling "
                     "(%s?); their inputs are offloaded again", offload, counted(len(wrapped), "layer"),
                     checkpointing_method(model))
        self.problems = {name: problem for problem, names in problems.items() for name in names}
        for problem, names in problems.items():
            warn_once(("offload off", tuple(names), problem), "offload=%r: the inputs of %s (%s) stay on the device "
                      "from now on: %s", offload, counted(len(names), "layer"),
                      ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""), problem)


def install_offload(model: torch.nn.Module, layers: list[torch.nn.Module],
                    decide: Optional[Callable[[int], Sequence[str]]] = None) -> Optional[LayerPlacement]:
    """Give each of ``layers`` (in forward order) the offloading checkpoint function (restoring any earlier one
    first), their inputs placed by ``decide`` (None: every one on the host), and keep it there
    (:class:`_KeepOffloading`). Returns the layers' placement (None without layers)."""
    uninstall_offload(model)
    if not layers:
        return None
    placement = LayerPlacement(len(layers), decide)
    for index, m in enumerate(layers):
        _wrap(m, index, placement)
    names = {m: n for n, m in model.named_modules()}
    hook = _KeepOffloading([names[m] for m in layers], placement)
    model.__dict__[_HOOK_ATTR] = (hook, model.register_forward_pre_hook(hook))
    return placement


def uninstall_offload(model: torch.nn.Module) -> None:
    for m in model.modules():
        if _SAVED_ATTR in m.__dict__:
            attr, original = m.__dict__.pop(_SAVED_ATTR)
            if isinstance(m.__dict__.get(attr), OffloadingCheckpointFunc):  # not one set since: that one stays
                setattr(m, attr, original)
    hook = model.__dict__.pop(_HOOK_ATTR, None)
    if hook is not None:
        hook[1].remove()


def offloaded_layers(model: torch.nn.Module) -> list[str]:
    """Qualified names of the modules whose checkpointed inputs are offloaded (not those whose checkpoint
    function was replaced since and could not be wrapped again: :func:`offload_problems`)."""
    return [name for name, m in model.named_modules()
            if _SAVED_ATTR in m.__dict__
            and isinstance(getattr(m, m.__dict__[_SAVED_ATTR][0]), OffloadingCheckpointFunc)]


def layer_placement(model: torch.nn.Module) -> Optional[LayerPlacement]:
    """The placement of ``model``'s offloaded layers (None when nothing is offloaded)."""
    hook = model.__dict__.get(_HOOK_ATTR)
    return hook[0].placement if hook is not None else None


def offload_problems(model: torch.nn.Module) -> dict[str, str]:
    """Layers ``offload="cpu"`` was enabled for whose inputs stay on the device now, and why."""
    hook = model.__dict__.get(_HOOK_ATTR)
    return dict(hook[0].problems) if hook is not None else {}
