"""Checkpointed activations offloaded to host memory, exact and overlapped with compute.

Design note — what is offloaded
-------------------------------
With non-reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(use_reentrant=False)``,
Hugging Face's ``gradient_checkpointing_enable``), a checkpointed region saves nothing of its own: its
recompute closure keeps the region's *inputs* alive on the GPU, from its forward to its recompute in
backward. For a decoder stack those inputs — each layer's hidden states, ``tokens x hidden`` — are what
is left at a million tokens (16 layers x 1M x 2048 x 2 bytes = 64 GiB). This module keeps them in
pinned host memory instead:

1. forward: each large floating-point tensor argument of a checkpointed call (``>= min_bytes``; masks,
   positions and other small arguments stay) is cloned into a tensor only the region holds, and the
   clone is copied to a pinned host buffer on a side stream right away; when the region's forward has
   returned, the clone's storage is freed (``resize_(0)``), the allocator told that the side stream
   still reads it (``record_stream``). The clone, not the caller's tensor, is freed: anyone else holding
   the caller's tensor (``output_hidden_states``, a residual) is never touched, and an output that
   aliases the clone keeps it on the GPU;
2. backward: a hook on the region's outputs fires when their first gradient arrives, before any node
   of the region runs (so before its recompute): it makes the compute stream wait for this region's
   copy back. A hook on the region's inputs fires when their gradient is computed, at the end of the
   region's backward: it starts the copy back of the previous region (``HostOffload.prefetch = "late"``,
   the default; ``"early"`` starts it from the first hook instead, which hides the copy completely but
   keeps one region's inputs more on the device at the peak of each region's backward), on the side
   stream, into storage allocated on the compute stream after an event — compute never reads a
   half-copied tensor, and the side stream never writes memory the compute stream still uses;
3. a host buffer returns to the pool as soon as its copy back is queued (later copies on the same side
   stream are ordered after it); buffers are kept, by size, across steps — nothing is pinned per step.

Design note — pinning the host buffers
--------------------------------------
The first step pins a whole step's layer inputs (8B model at 128K tokens: 32 buffers of 1 GiB). Pinning
with ``torch.empty(..., pin_memory=True)`` (``cudaHostAlloc``) took 0.40 s per GiB on an H200 host, on the
step's critical path: 13.2 s of the first step, of which 5.5 s showed as a slower step. The buffers are
instead ``malloc``'d, their pages touched, and registered (``cudaHostRegister``): 0.16 s per GiB, at their
exact size (the caching host allocator rounds up to a power of two). And they are pinned in order on a
worker thread: the first region that asks for a size waits for its own buffer (0.04 s for the 256 MiB of a
32K-token layer input), the step's other ``expected_regions - 1`` are pinned while the GPU computes, so later
regions find theirs ready. Measured on an H200 (8B shape, 32 layers, 128K tokens): the first step's wait for
host buffers fell from 13.2 s to 0.19 s, its overhead over later steps from 5.5 s to 2.4 s. Registered
buffers are unregistered when their offloader goes away.

The copies are bit-exact, so losses and gradients are identical to the run without offload. Memory:
one region's inputs on the GPU at a time during backward (plus, between two regions' backward, the one
being prefetched), instead of all of them. Host memory: the sum of all regions' inputs, checked against
the host's available memory when a step first needs more buffers (a ``MemoryError`` before the copies,
not the OOM killer).
Communication: none.

On a CPU device the same mechanics run synchronously (copy to a separate host buffer, free, copy back):
that is what the CPU tests exercise.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.profiler import record_function

from .logs import warn_once

log = logging.getLogger("tiledmlp")

__all__ = ["HostOffload", "OffloadingCheckpointFunc", "OFFLOAD_TARGETS", "checkpoint", "checkpointed_layers",
           "install_offload", "uninstall_offload", "offloaded_layers", "offload_problems", "offloader_for"]

OFFLOAD_TARGETS = ("cpu",)
MIN_BYTES = 1 << 20  # arguments smaller than this stay on the device
_HOST_MARGIN = 2 << 30  # host memory left free for everything else
_SAVED_ATTR = "_tiledmlp_offload_saved"
_HOOK_ATTR = "_tiledmlp_offload_hook"


def _available_host_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass
class _Region:
    """One checkpointed call's offloaded inputs: the device tensors (storage freed between forward and
    backward), their host copies, and the event that says a copy back has landed."""

    owner: "HostOffload"
    tensors: list[torch.Tensor]
    hosts: list[torch.Tensor]
    nbytes: list[int]
    seq: int = 0  # order of the region's forward
    ready: Any = None  # CUDA event of the copy back; None before it starts (or on a CPU)
    restored: bool = False
    # [released]: shared with the finalizer that returns the buffers of a region backward never reached
    released: list = field(default_factory=lambda: [False], repr=False)

    def restore(self) -> None:
        """Start copying back (idempotent); on a CPU, copy back now."""
        if self.restored:
            return
        self.restored = True
        owner = self.owner
        for t, n in zip(self.tensors, self.nbytes):
            t.untyped_storage().resize_(n)  # allocated on the current (compute) stream
        # Written through fresh aliases: the checkpoint saved the inputs with their version counters,
        # which a copy into the tensors themselves would bump (and the recompute would refuse).
        pairs = [(_alias(t), h.view(t.dtype).view(t.shape)) for t, h in zip(self.tensors, self.hosts)]
        if owner.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
        else:
            allocated = torch.cuda.Event()
            allocated.record()
            with torch.cuda.stream(owner.stream):
                owner.stream.wait_event(allocated)
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                self.ready = torch.cuda.Event()
                self.ready.record(owner.stream)
        self.release_hosts()  # later uses of the buffers are queued after these copies
        # The region lives as long as the graph (its hook is on the outputs' node); the tensors must not: the
        # checkpoint frees them after the region's backward, as without offload.
        self.tensors = []

    def wait(self) -> None:
        if self.ready is not None:
            torch.cuda.current_stream().wait_event(self.ready)

    def release_hosts(self) -> None:
        _release(self.owner, self.hosts, self.released)

    def keep(self, aliased: set[int]) -> None:
        """Stop offloading the inputs at positions ``aliased`` (an output shares their storage, so they stay
        on the device); their host buffers go back to the pool. In place: the finalizer holds these lists."""
        self.owner.give_back([h for k, h in enumerate(self.hosts) if k in aliased])
        for values in (self.tensors, self.hosts, self.nbytes):
            values[:] = [v for k, v in enumerate(values) if k not in aliased]


_PAGE = 4096


def _page_locked(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory: allocated, its pages touched (in parallel), registered with CUDA."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf[::_PAGE].zero_()  # fault the pages in: registering them one by one is slower
    cudart = torch.cuda.cudart()
    if cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0) != cudart.cudaError.success:
        raise RuntimeError(f"offload='cpu' could not page-lock {nbytes / 2**30:.2f} GiB of host memory "
                           "(cudaHostRegister failed); use offload=None, or raise the locked-memory limit (ulimit -l)")
    return buf


def _unregister(device: torch.device, buffers: list[torch.Tensor]) -> None:
    """Unpin an offloader's buffers (before their memory is freed), once no copy uses them."""
    if not buffers or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize(device)
    cudart = torch.cuda.cudart()
    for buf in buffers:
        cudart.cudaHostUnregister(buf.data_ptr())
    buffers.clear()


def _release(owner: "HostOffload", hosts: list[torch.Tensor], released: list) -> None:
    if not released[0]:
        released[0] = True
        owner.give_back(hosts)


class HostOffload:
    """Offloads the inputs of checkpointed regions on ``device`` to host memory (see the design note).

    One instance per device serves every checkpointed call on it; ``stats`` counts regions, bytes and
    host buffers allocated (for tests and ``describe``)."""

    #: when the previous region's copy back starts: ``"early"``, as a region's backward begins (the copy hides
    #: behind the whole region; its inputs are on the device during the region's backward, peak included), or
    #: ``"late"``, when the region's input gradient is computed, at the end of its backward (the next region
    #: waits for the copy; one region's inputs fewer at the peak)
    #: measured on an H200 (16-layer Llama-3.2-1B shape, loss=True): at 512K tokens "late" peaks at 45.84 GiB
    #: against 47.73 in 212.1 s against 210.3 s (no offload: 74.14 GiB, 213.9 s); at 128K 14.95 vs 15.33 GiB
    prefetch = "late"

    def __init__(self, device: torch.device, min_bytes: Optional[int] = None, expected_regions: int = 0) -> None:
        self.device = device
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self.expected_regions = expected_regions  # layers per step: the host-memory check, buffers pinned ahead
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._free: dict[int, list[torch.Tensor]] = {}
        self._pending: dict[int, list[Future]] = {}  # buffers being pinned ahead, by size
        self._sizes: dict[int, int] = {}  # buffers allocated (or being pinned), by size
        self._pinner: Optional[ThreadPoolExecutor] = None
        self._registered: list[torch.Tensor] = []  # unregistered when this offloader goes away
        if self.stream is not None:
            weakref.finalize(self, _unregister, device, self._registered)
        self._live: list[weakref.ref] = []  # regions not yet restored, in forward order
        self._seq = 0
        self.stats = {"regions": 0, "offloaded_bytes": 0, "restored": 0, "host_buffers": 0, "host_bytes": 0}

    # -- host buffers ------------------------------------------------------------------------------

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes``: from the pool, else the next one pinned ahead, else (on a GPU) the step's
        buffers of this size pinned on a worker thread, the first waited for (see the design note)."""
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        pending = self._pending.get(nbytes)
        if pending:
            return pending.pop(0).result()
        self._check_host_memory(nbytes)
        if self.stream is None:  # a CPU device: nothing to pin
            self._count(nbytes, 1)
            return torch.empty(nbytes, dtype=torch.uint8)
        # All of a step's buffers of this size pinned in order by one worker thread: the first is waited for here,
        # the others come while the GPU computes (pinning pages from two threads at once contends for the
        # process's page tables: measured slower).
        if self._pinner is None:
            self._pinner = ThreadPoolExecutor(1, thread_name_prefix="tiledmlp-pin")
        count = max(self.expected_regions - self._sizes.get(nbytes, 0), 1)
        self._count(nbytes, count)
        first, *ahead = [self._pinner.submit(self._page_locked, nbytes) for _ in range(count)]
        self._pending[nbytes] = ahead
        return first.result()

    def _count(self, nbytes: int, buffers: int) -> None:
        self._sizes[nbytes] = self._sizes.get(nbytes, 0) + buffers
        self.stats["host_buffers"] += buffers
        self.stats["host_bytes"] += buffers * nbytes

    def _page_locked(self, nbytes: int) -> torch.Tensor:
        buf = _page_locked(nbytes)
        self._registered.append(buf)
        return buf

    def _check_host_memory(self, nbytes: int) -> None:
        """Refuse, before copying, a step whose offloaded inputs cannot fit in host memory."""
        available = _available_host_bytes()
        if available is None:
            return
        regions = max(self.expected_regions - self.stats["host_buffers"], 1)
        need = nbytes * regions
        if need + _HOST_MARGIN > available:
            raise MemoryError(
                f"offload='cpu' needs about {need / 2**30:.1f} GiB more host memory for this step's checkpointed "
                f"activations ({regions} regions of {nbytes / 2**30:.2f} GiB), but {available / 2**30:.1f} GiB is "
                "available. Use fewer tokens per step, more host memory, or offload=None.")

    def give_back(self, hosts: list[torch.Tensor]) -> None:
        for h in hosts:
            self._free.setdefault(h.numel(), []).append(h)

    # -- one checkpointed call ---------------------------------------------------------------------

    def wants(self, value: Any) -> bool:
        return (isinstance(value, torch.Tensor) and value.is_floating_point() and value.device == self.device
                and value.numel() * value.element_size() >= self.min_bytes and not _is_subclass(value))

    def run(self, checkpoint_fn: Callable[..., Any], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``checkpoint_fn(fn, *args, **kwargs)`` with the large tensor arguments offloaded between the
        region's forward and its recompute."""
        if not torch.is_grad_enabled():
            return checkpoint_fn(fn, *args, **kwargs)
        positions = [i for i, a in enumerate(args) if self.wants(a)]
        if not positions:
            return checkpoint_fn(fn, *args, **kwargs)
        with record_function("tiledmlp::offload_out"):
            args = list(args)
            clones = [args[i].clone() for i in positions]  # a tensor only the region holds (see note)
            for i, c in zip(positions, clones):
                args[i] = c
            region = self._send(clones)
        out = checkpoint_fn(fn, *args, **kwargs)
        outs = [t for t in _tensors(out) if t.requires_grad]
        storages = {t.untyped_storage().data_ptr() for t in _tensors(out)}
        region.keep({k for k, c in enumerate(clones) if c.untyped_storage().data_ptr() in storages})
        with record_function("tiledmlp::offload_free"):
            for c in region.tensors:
                if self.stream is not None:
                    c.record_stream(self.stream)
                c.untyped_storage().resize_(0)
        if outs and region.tensors:
            torch.autograd.graph.register_multi_grad_hook(outs, functools.partial(_before_backward, region),
                                                          mode="any")
            if self.prefetch == "late":
                inputs = [c for c in clones if c.requires_grad]
                if inputs:
                    torch.autograd.graph.register_multi_grad_hook(inputs, functools.partial(_after_backward, region),
                                                                  mode="any")
        else:
            region.restore()  # nothing will recompute it (or nothing was offloaded): put it back
        return out

    def _send(self, tensors: list[torch.Tensor]) -> _Region:
        nbytes = [t.numel() * t.element_size() for t in tensors]
        hosts = [self._host_buffer(n) for n in nbytes]
        if self.stream is None:
            for t, h in zip(tensors, hosts):
                h.view(t.dtype).view(t.shape).copy_(t)
        else:
            computed = torch.cuda.Event()
            computed.record()
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(computed)
                for t, h in zip(tensors, hosts):
                    h.view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
        self._seq += 1
        region = _Region(self, list(tensors), hosts, nbytes, seq=self._seq)
        weakref.finalize(region, _release, self, region.hosts, region.released)
        self._live = [ref for ref in self._live if (r := ref()) is not None and not r.restored]
        self._live.append(weakref.ref(region))
        self.stats["regions"] += 1
        self.stats["offloaded_bytes"] += sum(nbytes)
        return region

    def previous(self, region: _Region) -> Optional[_Region]:
        """The region offloaded last before ``region`` and not restored yet (the next one backward
        reaches), if any."""
        earlier = [r for r in (ref() for ref in self._live) if r is not None and not r.restored and r.seq < region.seq]
        return max(earlier, key=lambda r: r.seq, default=None)


def _before_backward(region: _Region, grads: Any) -> None:
    """Runs when the region's first output gradient arrives, before its recompute: its inputs back (and
    the previous region's on their way)."""
    with record_function("tiledmlp::offload_in"):
        region.restore()
        region.wait()
        region.owner.stats["restored"] += 1
        if region.owner.prefetch == "early":
            _prefetch_previous(region)


def _after_backward(region: _Region, grads: Any) -> None:
    """Runs when the region's input gradient is computed (``prefetch = "late"``): the previous region's inputs
    on their way."""
    with record_function("tiledmlp::offload_in"):
        _prefetch_previous(region)


def _prefetch_previous(region: _Region) -> None:
    ahead = region.owner.previous(region)
    if ahead is not None:
        ahead.restore()


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s storage and layout with a version counter of its own."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                                t.shape, t.stride())


def _is_subclass(t: torch.Tensor) -> bool:
    return type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


# ----------------------------------------------------------------------------------------------
# Entry points: a drop-in checkpoint for custom models, and Hugging Face's per-layer checkpoint function

_OFFLOADERS: dict[torch.device, HostOffload] = {}


def offloader_for(device: torch.device, expected_regions: int = 0) -> HostOffload:
    """The process's offloader for ``device`` (its host buffers are shared by every model on it)."""
    offloader = _OFFLOADERS.get(device)
    if offloader is None:
        offloader = _OFFLOADERS[device] = HostOffload(device)
    offloader.expected_regions = max(offloader.expected_regions, expected_regions)
    return offloader


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
    if use_reentrant:
        raise ValueError("tiledmlp.checkpoint offloads the inputs of non-reentrant checkpointing only (reentrant "
                         "checkpointing saves them itself); call it with use_reentrant=False.")
    ckpt = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False,
                             preserve_rng_state=preserve_rng_state)
    device = _device_of(args)
    if offload is None or device is None:
        return ckpt(function, *args, **kwargs)
    return offloader_for(device).run(ckpt, function, *args, **kwargs)


class OffloadingCheckpointFunc:
    """A layer's checkpoint function (Hugging Face's ``_gradient_checkpointing_func``, ``CheckpointWrapper``'s
    ``checkpoint_fn``: ``functools.partial(checkpoint, use_reentrant=False, ...)``) with the layer's input
    offloaded (``HostOffload.run``)."""

    __slots__ = ("original", "layers")

    def __init__(self, original: Callable[..., Any], layers: int) -> None:
        self.original, self.layers = original, layers

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        device = _device_of(args)
        if device is None:
            return self.original(function, *args, **kwargs)
        return offloader_for(device, self.layers).run(self.original, function, *args, **kwargs)


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


def checkpointed_layers(model: torch.nn.Module, offload: Optional[str]) -> list[torch.nn.Module]:
    """The modules whose checkpointed inputs ``offload`` moves (none for None); ValueError, naming the fix,
    when the model does not checkpoint or checkpoints reentrantly. Changes nothing."""
    _check_target(offload)
    if offload is None:
        return []
    flagged = [m for m in model.modules() if callable(_original_func(m))]
    # Transformers 5 checkpoints in each GradientCheckpointingLayer (the base model keeps a flag it does not
    # use); older modeling code calls the base model's function once per layer.
    hf_layers = [m for m in flagged if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)]
    layers = hf_layers + [m for m in flagged if _func_attr(m) == "checkpoint_fn"] if hf_layers else flagged
    if not layers:
        raise ValueError(
            f"offload={offload!r} moves checkpointed activations to the host, but no module of "
            f"{type(model).__name__} checkpoints: call model.gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False}) (activation_checkpointing_enable in recent "
            "transformers) before enable_tiling, or wrap the layers with torch's checkpoint_wrapper (torchtitan's "
            "apply_ac), or, in a custom model, use tiledmlp.checkpoint(fn, *args) where it calls "
            "torch.utils.checkpoint.checkpoint.")
    for m in layers:
        if _checkpoint_problem(m):
            raise ValueError(
                f"offload={offload!r} needs non-reentrant checkpointing (torch.utils.checkpoint with "
                f"use_reentrant=False), but {type(m).__name__} checkpoints with {_original_func(m)!r}: call "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}), or "
                "checkpoint_wrapper(..., checkpoint_impl=CheckpointImpl.NO_REENTRANT).")
    return layers


def _checkpoint_problem(module: torch.nn.Module) -> str:
    """Why ``module``'s inputs cannot be offloaded now ("" if they can: it checkpoints non-reentrantly)."""
    func = _original_func(module)
    if not callable(func):
        return "it no longer checkpoints (gradient checkpointing was disabled)"
    if not (isinstance(func, functools.partial) and func.func is torch.utils.checkpoint.checkpoint
            and func.keywords.get("use_reentrant") is False):
        return (f"it now checkpoints with {func!r}, not torch.utils.checkpoint with use_reentrant=False (pass "
                "gradient_checkpointing_kwargs={'use_reentrant': False}, and no offload=True of transformers' own)")
    return ""


def _wrap(module: torch.nn.Module, layers: int) -> None:
    attr = _func_attr(module)
    original = module.__dict__[attr]
    module.__dict__[_SAVED_ATTR] = (attr, original)
    setattr(module, attr, OffloadingCheckpointFunc(original, layers))


class _KeepOffloading:
    """Forward pre-hook on the model ``enable_tiling`` was given: a layer whose checkpoint function was replaced
    since — ``Trainer(args=TrainingArguments(gradient_checkpointing=True))`` calls ``gradient_checkpointing_enable``
    (``activation_checkpointing_enable``) when training starts — gets the offloading one again when the new one is
    non-reentrant torch checkpointing; otherwise its inputs stay on the device, said once and in ``describe()``.
    Holds the layers' names (copies and pickles of the model keep working)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.problems: dict[str, str] = {}  # layer -> why its inputs are not offloaded now

    def __call__(self, model: torch.nn.Module, args: Any) -> None:
        wrapped, problems = [], {}
        for name in self.names:
            layer = model.get_submodule(name)
            attr, _ = layer.__dict__[_SAVED_ATTR]
            if isinstance(layer.__dict__.get(attr), OffloadingCheckpointFunc):
                continue
            problem = _checkpoint_problem(layer)
            if problem:
                problems.setdefault(problem, []).append(name)
            else:
                _wrap(layer, len(self.names))
                wrapped.append(name)
        if wrapped:
            log.info("offload='cpu': the checkpoint function of %d layers was replaced since enable_tiling "
                     "(gradient_checkpointing_enable?); their inputs are offloaded again", len(wrapped))
        self.problems = {name: problem for problem, names in problems.items() for name in names}
        for problem, names in problems.items():
            warn_once(("offload off", tuple(names), problem), "offload='cpu': the inputs of %d layers (%s) stay on the "
                      "device from now on: %s", len(names), ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""),
                      problem)


def install_offload(model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    """Give each of ``layers`` the offloading checkpoint function (restoring any earlier one first), and keep it
    there (:class:`_KeepOffloading`)."""
    uninstall_offload(model)
    for m in layers:
        _wrap(m, len(layers))
    if layers:
        names = {m: n for n, m in model.named_modules()}
        hook = _KeepOffloading([names[m] for m in layers])
        model.__dict__[_HOOK_ATTR] = (hook, model.register_forward_pre_hook(hook))


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
            if _SAVED_ATTR in m.__dict__ and isinstance(getattr(m, m.__dict__[_SAVED_ATTR][0]), OffloadingCheckpointFunc)]


def offload_problems(model: torch.nn.Module) -> dict[str, str]:
    """Layers ``offload="cpu"`` was enabled for whose inputs stay on the device now, and why."""
    hook = model.__dict__.get(_HOOK_ATTR)
    return dict(hook[0].problems) if hook is not None else {}
