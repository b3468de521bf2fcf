"""An optimizer's step fused into backward: each parameter stepped, and its gradient freed, as soon as its gradient
is complete, so that the gradients of a model never all exist at once.

[Note: stepping one parameter of an existing optimizer]
Autograd runs a leaf's ``AccumulateGrad`` once per backward, however many times the leaf was used (tied embeddings
included: the uses' gradients are summed into its input first), and then its post-accumulate-grad hooks
(``Tensor.register_post_accumulate_grad_hook``, as torchtune's ``optimizer_in_bwd`` and PyTorch's tutorial "How to
save memory by fusing the optimizer step into the backward pass"). There, the optimizer steps that one parameter: its
``param_groups`` are, for the length of that ``step()``, one copy of the parameter's group holding only it (the
group's hyperparameters as they are now: a learning-rate scheduler's changes are seen), so the optimizer's own code
runs, with its own states (``optimizer.state`` keyed by the parameter, as always: ``state_dict()`` is the optimizer's
usual one). Then the gradient is freed. Per element the same arithmetic as a step over every parameter (torch's
fused, foreach and for-loop AdamW compute each element alone), so the result is bit-identical to stepping after
backward.

What cannot be exact, and is refused or said:

* **gradient accumulation over micro-batches**: a parameter whose gradient completes twice before the user's
  ``optimizer.step()`` raises (its first micro-batch's step already happened: train with one micro-batch per step,
  or leave the optimizer on the device);
* **data parallelism**: DDP, FSDP and ZeRO average the gradients across ranks after this moment; refused when this
  process has peers (``torch.distributed`` initialized with more than one rank);
* **global-norm clipping** (``clip_grad_norm_``) needs every gradient first: after backward it finds none and
  clips nothing. It cannot be seen from here; the Trainer integration refuses ``max_grad_norm > 0``.

``optimizer.step()`` and ``zero_grad()`` stay callable (they find no gradient left and do nothing but mark the step
boundary), so training loops and the Trainer run unchanged.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .spec import HOST, spec_of

__all__ = ["StepInBackward", "step_in_backward", "is_stepped_in_backward", "GradientAccumulationError"]

#: each optimizer stepped in backward -> its handle (the optimizer owns the handle; neither keeps the other alive here)
_INSTALLED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[StepInBackward]]" = (
    weakref.WeakKeyDictionary())


class GradientAccumulationError(RuntimeError):
    """A parameter's gradient completed twice between two ``optimizer.step()`` calls of an optimizer stepped in
    backward ([Note: stepping one parameter of an existing optimizer])."""


def is_stepped_in_backward(optimizer: Any) -> bool:
    """Whether :func:`step_in_backward` steps ``optimizer`` (or the one inside accelerate's wrapper)."""
    inner = getattr(optimizer, "optimizer", None)
    ref = _INSTALLED.get(inner if isinstance(inner, torch.optim.Optimizer) else optimizer)
    return ref is not None and ref() is not None


class StepInBackward:
    """The handle of :func:`step_in_backward`: ``remove()`` puts the optimizer back to stepping after backward. The
    optimizer owns it (through its step pre-hook) and the parameters' hooks only refer to it: an optimizer that is
    dropped stops stepping them, and its hooks go with it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = weakref.ref(optimizer)
        self._group_of = {p: group for group in optimizer.param_groups for p in group["params"]}
        self._stepped: set[int] = set()  # ids of the parameters stepped since the user's last optimizer.step()
        self._inside = False  # a step of ours is running (the step pre-hook then is not the user's)
        self._lock = threading.Lock()  # autograd may run hooks of several devices' parameters on their own threads
        me = weakref.ref(self)

        def accumulated(p: torch.Tensor) -> None:
            handle = me()
            if handle is not None:
                handle._step(p)

        self._handles = [p.register_post_accumulate_grad_hook(accumulated) for p in self._group_of if p.requires_grad]
        self._handles.append(optimizer.register_step_pre_hook(self._user_step))  # the optimizer holds this handle
        weakref.finalize(self, _remove, self._handles)
        _INSTALLED[optimizer] = me

    def _step(self, p: torch.Tensor) -> None:
        optimizer = self._optimizer()
        if optimizer is None:
            return
        with self._lock:
            if id(p) in self._stepped:
                raise GradientAccumulationError(
                    "a parameter's gradient completed twice since the last optimizer.step(): the optimizer steps "
                    "inside backward (tiledmlp.optimizers.step_in_backward), so gradient accumulation over "
                    "micro-batches cannot be exact (the first micro-batch has been stepped already). Use one "
                    "micro-batch per optimizer step, or the optimizer placement 'gpu' or 'host'")
            own = optimizer.param_groups
            optimizer.param_groups = [{**self._group_of[p], "params": [p]}]
            self._inside = True
            try:
                optimizer.step()
            finally:
                optimizer.param_groups = own
                self._inside = False
            p.grad = None
            self._stepped.add(id(p))

    def _user_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._inside:  # the training loop's optimizer.step(): a step boundary
            self._stepped.clear()

    def remove(self) -> None:
        _remove(self._handles)
        optimizer = self._optimizer()
        if optimizer is not None:
            _INSTALLED.pop(optimizer, None)


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def step_in_backward(optimizer: torch.optim.Optimizer) -> StepInBackward:
    """Step each parameter of ``optimizer`` inside backward, as soon as its gradient is complete, and free that
    gradient ([Note: stepping one parameter of an existing optimizer]): the gradients of the model never all exist.
    Bit-identical to stepping after backward.
    ``optimizer``: any torch optimizer that skips parameters without a gradient (torch's, bitsandbytes'), or the
    one inside accelerate's ``AcceleratedOptimizer``. Refused for a host-placed optimizer (its step is on the CPU),
    under data parallelism, and twice on one optimizer. Memory: the states as before; at most the gradients of the
    parameters whose backward is running. Communication: none."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        optimizer = inner  # accelerate's AcceleratedOptimizer: its step() calls the inner one's
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"step_in_backward takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if is_stepped_in_backward(optimizer):
        raise ValueError("this optimizer already steps in backward (step_in_backward was called on it before)")
    if spec_of(optimizer).placement == HOST:
        raise ValueError(f"{type(optimizer).__name__} steps on the host (its states are there): stepping it in "
                         "backward would copy every parameter each time; use it as it is")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1:
        raise ValueError(f"step_in_backward steps each parameter when its gradient on this rank is complete, but "
                         f"this process has {world - 1} peer(s): a data-parallel wrapper (DDP, FSDP, ZeRO) averages "
                         "the gradients after that moment. Keep the optimizer on the device, or offload it through "
                         "the engine (DeepSpeed offload_optimizer, FSDP2 CPUOffloadPolicy)")
    return StepInBackward(optimizer)

