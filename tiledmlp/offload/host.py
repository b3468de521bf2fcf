"""Checkpointed activations offloaded to host memory, exact and overlapped with compute.

[Note: what is offloaded]
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

[Note: pinning the host buffers]
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
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.profiler import record_function

from ..core.logs import warn_once
from .host_memory import HOST_MARGIN, available_host_bytes
from .storage import fresh_alias, tensors_in

__all__ = ["HostOffload", "MIN_BYTES"]

MIN_BYTES = 1 << 20  # arguments smaller than this stay on the device


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
        pairs = [(fresh_alias(t), h.view(t.dtype).view(t.shape)) for t, h in zip(self.tensors, self.hosts)]
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

    def present(self) -> None:
        """The inputs back on the device now, for the compute stream (a recompute chain needs them early)."""
        self.restore()
        self.wait()

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
    """Offloads the inputs of checkpointed regions on ``device`` to host memory (see [Note: what is offloaded]).

    One instance per device serves every checkpointed call on it; ``stats`` counts regions, bytes and
    host buffers allocated (for tests and ``describe``)."""

    #: when the previous region's copy back starts: ``"early"``, as a region's backward begins (the copy hides
    #: behind the whole region; its inputs are on the device during the region's backward, peak included), or
    #: ``"late"``, when the region's input gradient is computed, at the end of its backward (the next region
    #: waits for the copy; one region's inputs fewer at the peak)
    #: measured on an H200 (16-layer Llama-3.2-1B shape, loss=True): at 512K tokens "late" peaks at 45.84 GiB
    #: against 47.73 in 212.1 s against 210.3 s (no offload: 74.14 GiB, 213.9 s); at 128K 14.95 vs 15.33 GiB
    prefetch = "late"

    def __init__(self, device: torch.device, min_bytes: Optional[int] = None) -> None:
        self.device = device
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self.expected_regions = 0  # layers offloaded per step (expect): the host-memory check, buffers pinned ahead
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

    def expect(self, regions: int) -> None:
        """This step offloads ``regions`` layer inputs: buffers are pinned ahead, and the host memory checked, for
        that many. Only the layers placed on the host count: a placement that keeps 5 of 8 layers on the device pins
        3 buffers, not 8 (pinning 8 held host memory for inputs that stayed on the device)."""
        self.expected_regions = regions

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes``: from the pool, else the next one pinned ahead, else (on a GPU) the step's
        buffers of this size pinned on a worker thread, the first waited for (see [Note: pinning the host buffers])."""
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
        available = available_host_bytes()
        if available is None:
            return
        regions = max(self.expected_regions - self.stats["host_buffers"], 1)
        need = nbytes * regions
        if need + HOST_MARGIN > available:
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
        return self.run_region(checkpoint_fn, fn, *args, **kwargs)[0]

    def run_region(self, checkpoint_fn: Callable[..., Any], fn: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> tuple[Any, tuple, Optional["_Region"]]:
        """:meth:`run`, also returning the arguments as the checkpoint got them (the offloaded ones are clones)
        and the region (None if nothing was offloaded): ``region.present()`` brings its inputs back now."""
        if not torch.is_grad_enabled():
            return checkpoint_fn(fn, *args, **kwargs), args, None
        positions = [i for i, a in enumerate(args) if self.wants(a)]
        if not positions:
            return checkpoint_fn(fn, *args, **kwargs), args, None
        with record_function("tiledmlp::offload_out"):
            args = list(args)
            clones = [args[i].clone() for i in positions]  # a tensor only the region holds (see note)
            for i, c in zip(positions, clones):
                args[i] = c
            region = self._send(clones)
        out = checkpoint_fn(fn, *args, **kwargs)
        outs = [t for t in tensors_in(out) if t.requires_grad]
        storages = {t.untyped_storage().data_ptr() for t in tensors_in(out)}
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
        return out, tuple(args), region

    def _send(self, tensors: list[torch.Tensor]) -> _Region:
        if self.stream is None:  # exact, and how the CPU tests exercise it, but it saves nothing
            warn_once(("offload from the host",), "offload='cpu': the checkpointed layers compute on the CPU, so their "
                      "inputs are only copied within host memory (no memory saved, results unchanged); it saves "
                      "device memory when the model is on a GPU")
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


def _is_subclass(t: torch.Tensor) -> bool:
    return type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter
