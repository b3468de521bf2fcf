"""Triton versions of the activation table (:mod:`tiledmlp.kernels.activations`), called from the GLU and plain-MLP
kernels (``glu_triton``, ``mlp_triton``); the torch references there are written the same way.

``ACTIVATION`` is a compile-time string: ``"silu"``, ``"gelu"`` (exact, erf), ``"gelu_tanh"`` (tanh approximation),
``"relu"`` or ``"relu2"`` (squared ReLU). The tanh form is evaluated through the identity
``0.5 * (1 + tanh(z)) = sigmoid(2 * z)``, which needs no tanh intrinsic and stays accurate where ``1 + tanh(z)``
would cancel. Inputs are float32; each function is a few float32 operations per element, in registers.
"""

import triton
import triton.language as tl

# Constants are inlined literals (Triton only reads module globals that are
# tl.constexpr, and constexpr-first arithmetic misbehaves in the interpreter):
#   0.7071067811865476 = 1 / sqrt(2)        0.3989422804014327 = 1 / sqrt(2 * pi)
#   1.5957691216057308 = 2 * sqrt(2 / pi)   0.044715 = GELU tanh cubic coefficient C, 0.134145 = 3 * C


@triton.jit
def activation(x, ACTIVATION: tl.constexpr):
    """act(x) for float32 ``x``."""
    if ACTIVATION == "silu":
        a = x * tl.sigmoid(x)
    elif ACTIVATION == "gelu":
        a = x * (0.5 + 0.5 * tl.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        a = x * tl.sigmoid(1.5957691216057308 * x * (1.0 + 0.044715 * x * x))
    elif ACTIVATION == "relu":
        a = tl.maximum(x, 0.0)
    else:
        tl.static_assert(ACTIVATION == "relu2")
        r = tl.maximum(x, 0.0)
        a = r * r
    return a


@triton.jit
def activation_and_grad(x, ACTIVATION: tl.constexpr):
    """(act(x), act'(x)) for float32 ``x``."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(x)
        a = x * s
        da = s * (1.0 + x * (1.0 - s))
    elif ACTIVATION == "gelu":
        cdf = 0.5 + 0.5 * tl.erf(x * 0.7071067811865476)
        a = x * cdf
        da = cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACTIVATION == "relu":
        a = tl.maximum(x, 0.0)
        da = tl.where(x > 0.0, 1.0, 0.0)
    elif ACTIVATION == "relu2":
        r = tl.maximum(x, 0.0)
        a = r * r
        da = 2.0 * r
    else:
        tl.static_assert(ACTIVATION == "gelu_tanh")
        x2 = x * x
        # s = 0.5 * (1 + tanh(z)) and 1 - tanh(z)^2 = 4 * s * (1 - s).
        s = tl.sigmoid(1.5957691216057308 * x * (1.0 + 0.044715 * x2))
        a = x * s
        da = s + 1.5957691216057308 * x * s * (1.0 - s) * (1.0 + 0.134145 * x2)
    return a, da
