"""Shared helpers for the single-process suites: build a reference copy, compare against it."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import torch
import transformers as tf
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from tiledmlp.core.compat import enable_checkpointing


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


def check_against_untiled(tiled: nn.Module, ref: nn.Module, x: torch.Tensor, tol: float = 2e-6,
                          grad=torch.ones_like) -> None:
    """One forward+backward of each on the same ``x`` and output gradient ``grad(output)``: output,
    input gradient and every parameter gradient within ``tol`` (float32: tiling only reorders sums)."""
    results = []
    for module in (tiled, ref):
        xx = x.detach().clone().requires_grad_()
        y = module(xx)
        y.backward(grad(y))
        results.append((y.detach(), xx.grad))
    (yt, gt), (yr, gr) = results
    assert_close_rel(yt, yr, tol, "output")
    assert_close_rel(gt, gr, tol, "input grad")
    assert_grads_match(tiled, ref, tol)


def bf16_signal(module: nn.Module, x: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> dict:
    xx = x.to(dtype).requires_grad_()
    y = module(xx)
    y.backward(g.to(dtype))
    return {"output": y.detach(), "input grad": xx.grad, **{n: p.grad for n, p in module.named_parameters()}}


def assert_bf16_within_untiled(base: nn.Module, tile, x: torch.Tensor, factor: float = 1.1) -> None:
    """bf16: ``tile(bf16 copy of base)``'s output, input gradient and parameter gradients are as close
    to a float64 run of the same weights as the untiled bf16 module's, within ``factor``."""
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(100)).to(x.device)
    want = bf16_signal(copy.deepcopy(base).double(), x, g, torch.float64)
    got_untiled = bf16_signal(copy.deepcopy(base).bfloat16(), x, g, torch.bfloat16)
    got_tiled = bf16_signal(tile(copy.deepcopy(base).bfloat16()), x, g, torch.bfloat16)
    for key, ref_value in want.items():
        e_untiled, e_tiled = rel_err(got_untiled[key], ref_value), rel_err(got_tiled[key], ref_value)
        assert 1e-4 < e_untiled < 5e-2, f"{key}: implausible untiled bf16 error {e_untiled:.2e}"
        assert e_tiled <= factor * e_untiled, f"{key}: tiled {e_tiled:.3e} vs untiled {e_untiled:.3e}"


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


# ----------------------------------------------------------------------------------------------
# Hugging Face model families, tiny random configs built in code

COMMON = dict(hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0,
              num_key_value_heads=2, vocab_size=96, max_position_embeddings=128, head_dim=8)
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40)

# family: (config class, model class, config extras, expected form of each layer's MLP)
FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}, "glu"),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {}, "glu"),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}, "glu"),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {}, "glu"),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {"hidden_act": "gelu_pytorch_tanh"}, "glu"),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, {}, "glu"),
    "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, {}, "glu"),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {}, "glu"),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, {}, "glu"),
    "glm4": (tf.Glm4Config, tf.Glm4ForCausalLM, {}, "glu"),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, {}, "glu"),
    # dense_h_to_4h -> GELU -> dense_4h_to_h, FalconLinear (an nn.Linear subclass with a forward of its own)
    "falcon": (tf.FalconConfig, tf.FalconForCausalLM, {"new_decoder_architecture": False}, "mlp"),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, MOE, "moe"),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, {**MOE, "decoder_sparse_step": 1, "mlp_only_layers": []}, "moe"),
}


def build(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    config_cls, model_cls, extra, _ = FAMILIES[family]
    # a family whose config computes one of the common sizes (Falcon's head_dim) is not given it
    config = config_cls(**{k: v for k, v in {**COMMON, **extra, **overrides}.items()
                           if not isinstance(getattr(config_cls, k, None), property)})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return model_cls(config).float()


def batch(vocab: int = 96, b: int = 2, t: int = 41, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def assert_compiled_layers_train_like_eager(eager: nn.Module, model: nn.Module, layers: nn.ModuleList, backend: str,
                                            lr: float) -> None:
    """``layers`` of ``model`` (a copy of the causal LM ``eager``) compiled with ``fullgraph=True``: two SGD steps of
    each on the same batches, every parameter within 1e-5 (relative) of eager's."""
    torch._dynamo.reset()
    for layer in layers:
        layer.compile(backend=backend, fullgraph=True)
    ids = [batch(t=t, seed=t) for t in (41, 29)]
    for m in (eager, model):
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=lr)
        for i in ids:
            opt.zero_grad()
            m(input_ids=i, labels=i).loss.backward()
            opt.step()
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        assert rel_err(q, p) < 1e-5, name
    torch._dynamo.reset()


def train_side_by_side(tiled: nn.Module, ref: nn.Module, steps: int = 3, tol: float = 1e-5) -> None:
    """``steps`` SGD steps of each causal LM on the same batches: losses, trainable parameters' gradients and the
    parameters after within ``tol`` (relative; gradients and parameters ``2 * tol``)."""
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for m in (tiled, ref)]
    for step in range(steps):
        ids = batch(t=37 + step, seed=step)
        losses = [m(input_ids=ids, labels=ids).loss for m in (tiled, ref)]
        for loss in losses:
            loss.backward()
        assert_close_rel(losses[0].detach(), losses[1].detach(), tol, f"loss of step {step}")
        for (name, p), q in zip(tiled.named_parameters(), ref.parameters()):
            if q.requires_grad:
                assert_close_rel(p.grad, q.grad, 2 * tol, f"{name} at step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    moved = [rel_err(p, q) for (n, p), q in zip(tiled.named_parameters(), ref.parameters()) if q.requires_grad]
    assert moved and max(moved) <= 2 * tol


def checkpointed_llama(layers: int = 4, dropout: float = 0.0, attn_implementation: str = "sdpa") -> nn.Module:
    """A tiny Llama (64 wide, 4/2 heads) with non-reentrant checkpointing per layer, in training mode."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=dropout,
                         attn_implementation=attn_implementation)
    model = tf.LlamaForCausalLM(config).train()
    enable_checkpointing(model)
    return model


def train_exactly(model: nn.Module, steps: int = 3, seed: int = 1, batch: int = 2,
                  tokens: int = 40) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """``steps`` SGD steps of a causal LM on fixed batches of ``batch`` x ``tokens`` (the RNG seeded per step:
    dropout draws the same masks in every run): each step's loss and gradients, for :func:`assert_identical`."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(128, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    out = []
    for k in range(steps):
        torch.manual_seed(100 + k)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def assert_identical(got, ref) -> None:
    """Two :func:`train_exactly` runs are bit for bit the same."""
    for (loss, grads), (loss_ref, grads_ref) in zip(got, ref, strict=True):
        assert torch.equal(loss, loss_ref)
        assert all(torch.equal(grads[n], grads_ref[n]) for n in grads_ref), \
            [n for n in grads_ref if not torch.equal(grads[n], grads_ref[n])]


class FixedPlacement:
    """An ``offload="auto"`` placement decided in advance (what ``AutoPlacement`` would return), counting its calls:
    each layer's input place and what it keeps for its recompute (``keeps``: each layer's kinds, default none)."""

    def __init__(self, places: tuple[str, ...], keeps: tuple[frozenset[str], ...] = ()) -> None:
        self.places, self.keeps, self.calls = places, keeps or (frozenset(),) * len(places), 0

    def __call__(self, nbytes: int) -> tuple[tuple[str, ...], tuple[frozenset[str], ...]]:
        self.calls += 1
        return self.places, self.keeps
