"""Shared helpers for the single-process suites: build a reference copy, compare against it."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP


def llama_mlp(hidden: int = 32, intermediate: int = 88, bias: bool = False, act: str = "silu",
              dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, mlp_bias=bias, hidden_act=act)
    mlp = LlamaMLP(cfg).to(dtype)
    if bias:  # HF initializes biases to zero: make them matter
        with torch.no_grad():
            for p in mlp.parameters():
                if p.dim() == 1:
                    p.normal_()
    return mlp


def pair(module: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(module, untouched deep copy)``: the first will be tiled, the second is the reference."""
    return module, copy.deepcopy(module)


def leaf_like(x: torch.Tensor, requires_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    a = x.detach().clone().requires_grad_(requires_grad)
    b = x.detach().clone().requires_grad_(requires_grad)
    return a, b


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_close_rel(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    err = rel_err(got, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def assert_grads_match(tiled: nn.Module, ref: nn.Module, tol: float = 1e-5) -> None:
    """Every parameter: same ``requires_grad``/``.grad is None`` status and close gradients."""
    ref_params = dict(ref.named_parameters())
    for name, p in tiled.named_parameters():
        q = ref_params[name]
        assert (p.grad is None) == (q.grad is None), f"{name}: grad None-ness differs ({p.grad is None} vs {q.grad is None})"
        if p.grad is not None:
            assert_close_rel(p.grad, q.grad, tol, name)


def run_interpreted(test_file: str, keyword: str) -> None:
    """Run ``test_file``'s tests matching ``keyword`` in a child pytest with ``TRITON_INTERPRET=1``
    (Triton picks interpreter or compiler when a kernel is defined, i.e. at import), so a plain CPU run
    exercises the Triton kernels; fails unless some ran and all passed."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-k", f"{keyword} and not CUDA"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreted Triton tests failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]
