"""The activation table: the activations the fused kernels compute (:data:`ACTIVATIONS`), the check that names
them (:func:`check_activation`), and their torch references (:func:`activation_torch`,
:func:`activation_and_grad_torch`), written like the Triton versions in :mod:`tiledmlp.kernels.activations_triton`.

The single source: the GLU and plain-MLP kernels take these names, and recognition's probe tries each of them
(``tiledmlp.recognize.probe``). A new activation is a row here, its Triton version beside it, and the names
modules give it (``tiledmlp.recognize.candidates.activation_name``).

``"silu"``, ``"gelu"`` (exact, erf), ``"gelu_tanh"`` (tanh approximation), ``"relu"``, ``"relu2"`` (squared ReLU).
Each reference costs a few float32 temporaries the size of its input.
"""

import torch
from torch import Tensor

__all__ = ["ACTIVATIONS", "activation_and_grad_torch", "activation_torch", "check_activation"]

ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")

_SQRT1_2 = 0.7071067811865476  # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 * pi)
_TWO_SQRT_2_OVER_PI = 1.5957691216057308  # 2 * sqrt(2 / pi)
_GELU_TANH_C = 0.044715  # gelu_tanh(x) = x * sigmoid(2 * sqrt(2 / pi) * (x + C * x^3))


def check_activation(activation: str) -> None:
    """ValueError naming the supported activations unless ``activation`` is one."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; supported: {', '.join(map(repr, ACTIVATIONS))}")


def activation_torch(x: Tensor, activation: str) -> Tensor:
    """act(x), written like the kernels' ``activation``."""
    if activation == "silu":
        return x * torch.sigmoid(x)
    if activation == "gelu":
        return x * (0.5 + 0.5 * torch.erf(x * _SQRT1_2))
    if activation == "relu":
        return x.clamp_min(0)
    if activation == "relu2":
        return x.clamp_min(0).square()
    return x * torch.sigmoid(_TWO_SQRT_2_OVER_PI * x * (1.0 + _GELU_TANH_C * x * x))


def activation_and_grad_torch(x: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """(act(x), act'(x)), written like the kernels' ``activation_and_grad``."""
    if activation == "silu":
        s = torch.sigmoid(x)
        return x * s, s * (1.0 + x * (1.0 - s))
    if activation == "gelu":
        cdf = 0.5 + 0.5 * torch.erf(x * _SQRT1_2)
        return x * cdf, cdf + x * _INV_SQRT_2PI * torch.exp(-0.5 * x * x)
    if activation in ("relu", "relu2"):
        r = x.clamp_min(0)
        return (r, (x > 0).to(x.dtype)) if activation == "relu" else (r * r, 2 * r)
    x2 = x * x
    s = torch.sigmoid(_TWO_SQRT_2_OVER_PI * x * (1.0 + _GELU_TANH_C * x2))
    return x * s, s + _TWO_SQRT_2_OVER_PI * x * s * (1.0 - s) * (1.0 + 3.0 * _GELU_TANH_C * x2)
