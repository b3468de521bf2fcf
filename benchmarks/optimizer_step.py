"""The optimizer of a benchmark's training step (``--optimizer``), shared by ``bench_longctx`` and ``bench_sp``: a
name of ``tiledmlp.optimizers.spec.NAMES`` with a placement after a colon (``adamw`` torch's fused AdamW on the
device, as the Trainer builds it; ``adamw-foreach``; ``adamw8bit``, bitsandbytes'; ``adamw:backward`` stepped in
backward; ``adamw:host`` torchao's CPU offload; ``adamw:auto`` where the memory plan places it within the budgets) or
``none`` (forward + backward only, as the figures before 0.5 were). A step with one is forward, backward,
``optimizer.step()`` and ``zero_grad()``, all timed, the peak taken over all of it."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
from torch import nn

import tiledmlp
from tiledmlp.optimizers.spec import NAMES, PLACEMENTS

__all__ = ["NONE", "parse_optimizers", "split", "training_steps", "LR"]

NONE = "none"
LR = 1e-4  # large enough that the loss of a repeated batch falls from step to step, small enough to stay finite


def split(choice: str) -> tuple[str, Optional[str]]:
    """``"adamw:host"`` -> ``("adamw", "host")``; ``"adamw"`` -> ``("adamw", "gpu")``; ``"adamw:auto"`` ->
    ``("adamw", None)`` (the plan places it)."""
    name, _, placement = choice.partition(":")
    return name, None if placement == "auto" else placement or "gpu"


def parse_optimizers(text: str) -> list[str]:
    """Comma-separated choices, each checked: ValueError naming the ones taken."""
    choices = [c.strip() for c in text.split(",") if c.strip()]
    for choice in choices:
        name, placement = split(choice)
        if choice != NONE and (name not in NAMES or placement not in (*PLACEMENTS, None)):
            raise ValueError(f"--optimizer {choice!r}: 'none', or a name of {sorted(NAMES)} with an optional "
                             f":placement of {[*PLACEMENTS, 'auto']}")
    return choices


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def training_steps(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], loss: Callable[[], torch.Tensor],
                   warmup: int, steps: int, device: torch.device) -> dict[str, Any]:
    """``warmup`` untimed then ``steps`` timed training steps: forward and backward of ``loss()``, and with an
    ``optimizer`` its step and ``zero_grad``. Returns the median step's seconds (``step_s``), the median optimizer
    step's (``optimizer_s``, NaN without), and every step's loss (``losses``)."""
    times, optimizer_times, losses = [], [], []
    for i in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        sync(device)
        begin = time.perf_counter()
        value = loss()
        value.backward()
        losses.append(float(value))
        del value
        if optimizer is not None:
            sync(device)
            stepping = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync(device)
            if i >= warmup:
                optimizer_times.append(time.perf_counter() - stepping)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - begin)
    median = sorted(times)[len(times) // 2]
    step = sorted(optimizer_times)[len(optimizer_times) // 2] if optimizer_times else float("nan")
    return {"step_s": median, "optimizer_s": step, "losses": ";".join(f"{v:.4f}" for v in losses),
            "loss": losses[-1]}


def make_states(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer``'s states before the measured steps, with a step on zero gradients: every step after a
    training run's first holds them, and the first makes them only in its ``optimizer.step()``, after backward's peak.
    AdamW's update of a zero gradient is zero and these have no weight decay, so no weight moves. torch's own
    optimizers only (stepped in backward or on the host, the step would not be the one measured)."""
    if not type(optimizer).__module__.startswith("torch.optim") or any(
            group.get("weight_decay") for group in optimizer.param_groups):
        raise ValueError(f"make_states: {type(optimizer).__name__} is not one of torch's optimizers without weight "
                         "decay, whose zero-gradient step moves no weight")
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def optimizer_for(model: nn.Module, choice: str) -> Optional[torch.optim.Optimizer]:
    """The optimizer ``choice`` for a model tiled with ``enable_tiling(..., optimizer=name, optimizer_placement=...)``
    (the placement its plan chose where ``choice`` says ``auto``); None for ``none``."""
    if choice == NONE:
        return None
    name, placement = split(choice)
    return tiledmlp.make_optimizer(model, name, placement, lr=LR, weight_decay=0.0)
