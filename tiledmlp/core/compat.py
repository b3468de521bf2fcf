"""What differs between the transformers and bitsandbytes releases tiledmlp supports (pyproject.toml's range; CI
tests its lowest and newest, ``scripts/versions/``): one function per difference, each branch tested on the release
that takes it (``tests/unit/core/test_compat.py``). Imports nothing of tiledmlp; transformers only when a model is not
one of its own, bitsandbytes only for a 4-bit weight."""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["checkpointing_method", "checkpointing_call", "enable_checkpointing", "matmul_4bit"]

# transformers 5.23 renamed the method that turns activation checkpointing on, and deprecates the old name (a
# FutureWarning on every call; its keyword argument is renamed alike).
ACTIVATION, GRADIENT = "activation_checkpointing_enable", "gradient_checkpointing_enable"


def checkpointing_method(model: Any = None) -> str:
    """The name of the Hugging Face method that turns activation checkpointing on: ``activation_checkpointing_enable``
    where ``model`` has it (transformers >= 5.23), else ``gradient_checkpointing_enable``. A model that has neither
    (not a Hugging Face model, or None) is answered for the installed transformers (the new name without one)."""
    if not (hasattr(model, ACTIVATION) or hasattr(model, GRADIENT)):
        try:
            from transformers import PreTrainedModel as model
        except ImportError:
            return ACTIVATION
    return ACTIVATION if hasattr(model, ACTIVATION) else GRADIENT


def checkpointing_call(model: Any = None) -> str:
    """The call that turns on non-reentrant checkpointing for ``model``, as a message names it:
    ``model.activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': False})`` (or the
    ``gradient_`` one, see :func:`checkpointing_method`)."""
    method = checkpointing_method(model)
    return f"model.{method}({_kwargs_of(method)}={{'use_reentrant': False}})"


def enable_checkpointing(model: Any, use_reentrant: bool = False) -> None:
    """Turns on ``model``'s activation checkpointing (a Hugging Face model, or a PEFT model around one) with the
    method of the installed transformers, non-reentrant unless asked."""
    method = checkpointing_method(model)
    getattr(model, method)(**{_kwargs_of(method): {"use_reentrant": use_reentrant}})


def _kwargs_of(method: str) -> str:
    """The keyword argument of ``method`` that takes torch's checkpoint options (renamed with it)."""
    return method.replace("_enable", "_kwargs")


def matmul_4bit(x: torch.Tensor, packed: torch.Tensor, quant_state: Any, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """bitsandbytes' ``matmul_4bit`` of ``x`` by a ``Linear4bit``'s packed weight, as its forward calls it: the packed
    weight itself from bitsandbytes 0.50, its transpose before (unless packed for the CPU's inference kernels)."""
    import bitsandbytes as bnb

    before_050 = tuple(int(n) for n in bnb.__version__.split(".")[:2]) < (0, 50)
    if before_050 and not getattr(quant_state, "packing_format_for_cpu", False):
        packed = packed.t()
    return bnb.matmul_4bit(x, packed, quant_state=quant_state, bias=bias)

