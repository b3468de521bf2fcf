"""MLP styles for the recognition tests: the same computation written the ways real code writes it.

``STYLES[name] = (factory, form tiledmlp must pick, activation)``; sizes ``H`` -> ``I`` -> ``H``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, Phi3Config, PhiConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.phi.modeling_phi import PhiMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP

from unit_helpers import llama_mlp

H, I = 32, 88
ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
        "relu2": lambda x: F.relu(x).square()}


class InlineGLU(nn.Module):
    """A Llama-named GLU that writes its activation inline (no ``act_fn`` attribute)."""

    def __init__(self, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, I, bias=bias), nn.Linear(H, I, bias=bias)
        self.down_proj = nn.Linear(I, H, bias=bias)
        self.act = act

    def forward(self, x):
        return self.down_proj(ACTS[self.act](self.gate_proj(x)) * self.up_proj(x))


class FeedForward(nn.Module):
    """torchtitan's Llama feed-forward: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(H, I, bias=False), nn.Linear(I, H, bias=False), nn.Linear(H, I, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TwoLayer(nn.Module):
    """A plain MLP under names no rule knows: ``expand -> act -> contract``, with biases."""

    def __init__(self, act: str = "gelu") -> None:
        super().__init__()
        self.expand, self.contract = nn.Linear(H, I), nn.Linear(I, H)
        self.act = act

    def forward(self, hidden):
        return self.contract(ACTS[self.act](self.expand(hidden)))


def biased(module: nn.Module) -> nn.Module:
    """Random biases (Hugging Face initializes them to zero, which would hide a misplaced bias)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.normal_()
    return module


STYLES = {
    # name: (factory, form, activation)
    "inline": (lambda: InlineGLU(), "glu", "silu"),
    "inline-gelu-bias": (lambda: biased(InlineGLU("gelu", bias=True)), "glu", "gelu"),
    "act_fn": (lambda: llama_mlp(), "glu", "silu"),
    "torchtitan": (FeedForward, "glu", "silu"),
    "phi3-fused": (lambda: Phi3MLP(Phi3Config(hidden_size=H, intermediate_size=I, hidden_act="silu")), "glu", "silu"),
    "plain-gelu": (lambda: biased(TwoLayer("gelu")), "mlp", "gelu"),
    "plain-gelu-tanh": (lambda: biased(TwoLayer("gelu_tanh")), "mlp", "gelu_tanh"),
    "plain-relu": (lambda: biased(TwoLayer("relu")), "mlp", "relu"),
    "plain-relu2": (lambda: biased(TwoLayer("relu2")), "mlp", "relu2"),
    "gpt2-conv1d": (lambda: biased(GPT2MLP(I, GPT2Config(n_embd=H, resid_pdrop=0.0))), "mlp", "gelu_tanh"),
    "phi2": (lambda: biased(PhiMLP(PhiConfig(hidden_size=H, intermediate_size=I, resid_pdrop=0.0))), "mlp",
             "gelu_tanh"),
}
