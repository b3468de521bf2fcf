"""Time, peak memory and accuracy of one MLP forward+backward, per provider and sequence length.

Providers (all start from the same weights, input and output gradient):

* ``eager``            the untiled block of the ``--style`` (default transformers' ``LlamaMLP``; ``MixtralSparseMoeBlock``
                       with ``--moe``, its experts as ``--experts-impl`` says, default the eager loop).
* ``grouped_mm``       MoE only: the untiled block with ``experts_implementation="grouped_mm"``.
* ``liger``            Liger-Kernel's untiled ``LigerSwiGLUMLP`` / ``LigerGEGLUMLP``.
* ``liger_tiled``      Liger-Kernel's ``LigerTiledSwiGLUMLP`` / ``LigerTiledGEGLUMLP`` (shards = ceil(T / H)).
* ``deepspeed_tiled``  DeepSpeed's ``TiledMLP.apply`` around the eager module's forward (shards = ceil(T / H)).
* ``tiledmlp``         the eager module after ``tiledmlp.enable_tiling(module)``; ``tiledmlp@N`` forces N shards.
* ``tiledmlp_generic``  the same with ``form="generic"`` (the module's own forward recomputed per shard).

Styles (``--style``, comma-separated to compare them in one run; each style's ratios are against its own
``eager``): ``act_fn`` (``LlamaMLP``: ``down(act_fn(gate(x)) * up(x))``), ``inline`` (the same names, activation
written inline), ``torchtitan`` (``w2(silu(w1(x)) * w3(x))``), ``plain`` (Phi-2's ``fc1 -> gelu_tanh -> fc2``
with biases; GPT-2-XL shape: ``--hidden 1600 --intermediate 6400``) and ``conv1d`` (GPT-2's ``Conv1D``
``c_fc``/``c_proj``). Liger providers exist for the ``act_fn`` and ``inline`` GLUs only.

``--lora R`` puts peft LoRA adapters of rank ``R`` (``lora_alpha = 2R``, no dropout) on every projection and
freezes the base weights, as ``get_peft_model`` does; the adapters are float32 (peft's
``autocast_adapter_dtype``) whatever ``dtype`` the base is, and the default providers become ``eager``,
``tiledmlp`` (the fast form with the adapters) and ``tiledmlp_generic``.

Accuracy is the relative L2 error against a float64 reference computed on the same device, token chunk by
token chunk (exact up to float64 rounding, and small enough to fit next to the benchmark at 128K tokens).

Run ``python3 benchmarks/bench_mlp.py --help``; ``--quick`` is a tiny smoke test that also runs on a CPU.
"""

from __future__ import annotations

import argparse
import ast
import csv
import datetime
import gc
import importlib
import importlib.metadata
import math
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # benchmark the checkout's tiledmlp, not an installed one

ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}
DENSE_PROVIDERS = ("eager", "liger", "liger_tiled", "deepspeed_tiled", "tiledmlp", "tiledmlp_fp32acc")
STYLES = ("act_fn", "inline", "torchtitan", "plain", "conv1d")
LIGER_STYLES = ("act_fn", "inline")  # Liger's GLU modules load these styles' weights (same names)
LORA_PROVIDERS = ("eager", "tiledmlp", "tiledmlp_generic")
MOE_PROVIDERS = ("eager", "grouped_mm", "deepspeed_tiled", "tiledmlp")
TRITON_ONLY = frozenset({"liger", "liger_tiled"})
FIXED_COLUMNS = (
    "provider", "style", "act", "T", "hidden", "intermediate", "dtype", "time_ms", "time_ratio_vs_eager", "peak_mib",
    "err_out", "err_dx", "err_w_max", "gpu_name", "torch", "triton", "transformers", "liger", "deepspeed",
    "tiledmlp", "date",
)
VERSION_DISTRIBUTIONS = {
    "torch": "torch", "triton": "triton", "transformers": "transformers", "liger": "liger-kernel",
    "deepspeed": "deepspeed", "tiledmlp": "tiledmlp", "cce": "cut-cross-entropy", "bitsandbytes": "bitsandbytes",
    "peft": "peft",
}
VERSION_MODULES = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}


@dataclass(frozen=True)
class Shape:
    """The block under test: a dense MLP of ``style``, or a Mixtral sparse MoE block when ``moe`` is set."""

    hidden: int
    intermediate: int
    act: str
    style: str = "act_fn"
    moe: bool = False
    experts: int = 8
    top_k: int = 2
    experts_impl: str = "eager"
    lora: int = 0  # rank of peft LoRA adapters on every projection (0: none)


@dataclass
class Runner:
    """A provider ready to run: ``forward(x)`` computes the block; ``module`` owns the parameters."""

    module: nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]
    form: str = ""  # tiledmlp: the form(s) its modules got (tiledmlp.describe)


@dataclass
class Reference:
    """Float64-accurate results (stored as float32) of one forward+backward."""

    out: torch.Tensor
    dx: torch.Tensor
    weight_grads: dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------------------------------
# Environment


def bench_device(smoke: bool) -> tuple[torch.device, torch.dtype]:
    """The GPU in bf16, or (``--smoke``, or no GPU) the CPU in float32."""
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def gpu_name(device: torch.device) -> str:
    """The accelerator's marketing name, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def gpu_slug(device: torch.device) -> str:
    """A file-name friendly form of :func:`gpu_name`, e.g. ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_name(device).lower()).strip("-")


def package_version(key: str) -> str:
    """Installed version of a package, or "n/a"."""
    try:
        return importlib.metadata.version(VERSION_DISTRIBUTIONS[key])
    except importlib.metadata.PackageNotFoundError:  # e.g. tiledmlp used from the checkout, not installed
        try:
            module = importlib.import_module(VERSION_MODULES.get(key, key))
        except ImportError:
            return "n/a"
        return str(getattr(module, "__version__", "n/a"))


def package_versions() -> dict[str, str]:
    """Versions of every package the CSV reports."""
    versions = {key: package_version(key) for key in VERSION_DISTRIBUTIONS if key != "cce"}
    versions["torch"] = torch.__version__
    return versions


def parse_options(text: str) -> dict[str, Any]:
    """Parse ``key=val,key=val`` into a dict; values are Python literals where they parse, else strings."""
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"option {item!r} is not key=value")
        try:
            options[key.strip()] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            options[key.strip()] = raw.strip()
    return options


def parse_variants(text: str, known: Sequence[str]) -> list[str]:
    """``--variants a,b`` as a list; exits naming the known ones when one is not."""
    variants = text.split(",")
    unknown = set(variants) - set(known)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(known)}")
    return variants


def release_memory() -> None:
    """Return cached blocks so that the next provider starts from the same free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------------
# Modules and providers


def hf_config(shape: Shape, experts_impl: Optional[str] = None) -> PretrainedConfig:
    """A transformers config describing ``shape`` (LlamaConfig, or MixtralConfig for MoE)."""
    from transformers import LlamaConfig, MixtralConfig

    if not shape.moe:
        return LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                           hidden_act=ACTIVATIONS[shape.act], mlp_bias=False)
    config = MixtralConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                           num_local_experts=shape.experts, num_experts_per_tok=shape.top_k,
                           hidden_act=ACTIVATIONS[shape.act], router_jitter_noise=0.0)
    config._experts_implementation = experts_impl or shape.experts_impl
    return config


class InlineGLU(nn.Module):
    """``LlamaMLP``'s names with the activation written inline (no ``act_fn`` attribute)."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.tanh_gelu = act == "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class FeedForward(nn.Module):
    """torchtitan's Llama ``FeedForward``: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def eager_module(shape: Shape, experts_impl: Optional[str] = None) -> nn.Module:
    """The untiled block: ``MixtralSparseMoeBlock``, or the dense MLP of ``shape.style`` (with LoRA adapters
    and frozen base weights when ``shape.lora``)."""
    module = _dense_or_moe_module(shape, experts_impl)
    if not shape.lora:
        return module
    from peft import LoraConfig, inject_adapter_in_model

    targets = [name for name, child in module.named_children()
               if isinstance(child, nn.Linear) or type(child).__name__ == "Conv1D"]
    config = LoraConfig(r=shape.lora, lora_alpha=2 * shape.lora, lora_dropout=0.0, target_modules=targets,
                        fan_in_fan_out=shape.style == "conv1d")
    module = inject_adapter_in_model(config, module)
    for name, param in module.named_parameters():
        param.requires_grad_("lora_" in name)
    return module


def _dense_or_moe_module(shape: Shape, experts_impl: Optional[str]) -> nn.Module:
    if shape.moe:
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        return MixtralSparseMoeBlock(hf_config(shape, experts_impl))
    if shape.style == "inline":
        return InlineGLU(shape.hidden, shape.intermediate, shape.act)
    if shape.style == "torchtitan":
        return FeedForward(shape.hidden, shape.intermediate)
    if shape.style == "plain":
        from transformers import PhiConfig
        from transformers.models.phi.modeling_phi import PhiMLP

        return PhiMLP(PhiConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                                hidden_act=ACTIVATIONS[shape.act], resid_pdrop=0.0))
    if shape.style == "conv1d":
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

        return GPT2MLP(shape.intermediate, GPT2Config(n_embd=shape.hidden, activation_function=ACTIVATIONS[shape.act],
                                                      resid_pdrop=0.0))
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(hf_config(shape))


def master_state_dict(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Weights every provider loads: uniform(+-1/sqrt(fan_in)) for every parameter, rounded to ``dtype``."""
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        module = eager_module(shape)
    state = {}
    for name, param in module.state_dict().items():
        bound = 1.0 / math.sqrt(param.shape[-1])
        values = torch.rand(param.shape, generator=generator, device=device) * (2 * bound) - bound
        state[name] = values.to(dtype)
    return state


def materialize(module: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
    """Cast ``module`` to ``dtype`` and load the shared weights into it; LoRA adapters at least float32, as
    peft keeps them."""
    module.to(dtype)
    module.load_state_dict(state)
    for name, param in module.named_parameters():
        if "lora_" in name and param.dtype.itemsize < 4:
            param.data = param.data.float()
    return module


def batched_forward(forward: Callable[..., torch.Tensor]) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """Adapt a module forward for DeepSpeed's TiledMLP: it recomputes 2-D ``[tokens, hidden]`` shards in
    backward, while the MoE block only takes ``[batch, tokens, hidden]``."""

    def fn(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return forward(module, x.unsqueeze(0) if x.dim() == 2 else x).view_as(x)

    return fn


def build_eager(shape: Shape, state: dict[str, torch.Tensor], dtype: torch.dtype, options: dict[str, Any]) -> Runner:
    """transformers' block as is."""
    module = materialize(eager_module(shape), state, dtype)
    return Runner(module, module)


def build_grouped_mm(shape: Shape, state: dict[str, torch.Tensor], dtype: torch.dtype,
                     options: dict[str, Any]) -> Runner:
    """The untiled MoE block with transformers' grouped-GEMM experts (``torch.nn.functional.grouped_mm``)."""
    if not shape.moe:
        raise ValueError("the grouped_mm provider is a MoE experts implementation: use it with --moe")
    module = materialize(eager_module(shape, experts_impl="grouped_mm"), state, dtype)
    return Runner(module, module)


def build_liger(shape: Shape, state: dict[str, torch.Tensor], dtype: torch.dtype, options: dict[str, Any]) -> Runner:
    """Liger's untiled GLU MLP (Triton activation kernel)."""
    from liger_kernel.transformers.geglu import LigerGEGLUMLP
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    cls = LigerSwiGLUMLP if shape.act == "silu" else LigerGEGLUMLP
    module = materialize(cls(hf_config(shape)), state, dtype)
    return Runner(module, module)


def build_liger_tiled(shape: Shape, state: dict[str, torch.Tensor], dtype: torch.dtype,
                      options: dict[str, Any]) -> Runner:
    """Liger's tiled GLU MLP with its automatic shard count."""
    from liger_kernel.transformers.tiled_mlp import LigerTiledGEGLUMLP, LigerTiledSwiGLUMLP

    cls = LigerTiledSwiGLUMLP if shape.act == "silu" else LigerTiledGEGLUMLP
    module = materialize(cls(hf_config(shape), num_shards=None), state, dtype)  # None: ceil(T / H)
    return Runner(module, module)


def build_deepspeed_tiled(shape: Shape, state: dict[str, torch.Tensor], dtype: torch.dtype,
                          options: dict[str, Any]) -> Runner:
    """DeepSpeed's TiledMLP around transformers' block forward, shards = ceil(T / H) as in its docstring."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    module = materialize(eager_module(shape), state, dtype)
    fn = batched_forward(type(module).forward)
    params = list(module.parameters())

    def forward(x: torch.Tensor) -> torch.Tensor:
        shards = math.ceil(x.shape[-2] / x.shape[-1])
        return TiledMLP.apply(fn, module, x, shards, params)

    return Runner(module, forward)


def build_tiledmlp(shape: Shape, state: dict[str, torch.Tensor], dtype: torch.dtype,
                   options: dict[str, Any]) -> Runner:
    """transformers' block after ``tiledmlp.enable_tiling(module, **options)``."""
    import tiledmlp

    module = materialize(eager_module(shape), state, dtype)
    tiledmlp.enable_tiling(module, **options)
    if not tiledmlp.tiled_modules(module):
        raise RuntimeError(f"tiledmlp.enable_tiling tiled nothing in {type(module).__name__}")
    return Runner(module, module, ",".join(info.form for info in tiledmlp.describe(module).values()))


def build_tiledmlp_generic(shape: Shape, state: dict[str, torch.Tensor], dtype: torch.dtype,
                           options: dict[str, Any]) -> Runner:
    """tiledmlp's generic form: the module's own forward, recomputed per shard in backward."""
    return build_tiledmlp(shape, state, dtype, {"form": "generic", **options})


def build_tiledmlp_fp32acc(shape: Shape, state: dict[str, torch.Tensor], dtype: torch.dtype,
                           options: dict[str, Any]) -> Runner:
    """tiledmlp with float32 gradient accumulators and a 1024 MiB scratch budget (8192-token shards):
    the most precise setting, and the fastest before the block-scaled accumulators."""
    return build_tiledmlp(shape, state, dtype, {"grad_accum_dtype": torch.float32, "scratch_mib": 1024, **options})


def compile_backend() -> str:
    """Inductor on a GPU; ``aot_eager`` on a CPU (inductor's CPU path needs a C++ toolchain; the smoke run
    checks the plumbing, not the speed)."""
    return "inductor" if torch.cuda.is_available() else "aot_eager"


def build_eager_compiled(shape: Shape, state: dict[str, torch.Tensor], dtype: torch.dtype,
                         options: dict[str, Any]) -> Runner:
    """transformers' block under ``torch.compile``."""
    module = materialize(eager_module(shape), state, dtype)
    return Runner(module, torch.compile(module, backend=compile_backend()))


def build_tiledmlp_compiled(shape: Shape, state: dict[str, torch.Tensor], dtype: torch.dtype,
                            options: dict[str, Any]) -> Runner:
    """The tiled block under ``torch.compile`` (each tiled call is one ``tiledmlp::tiled_call`` operator in its graph)."""
    runner = build_tiledmlp(shape, state, dtype, options)
    return Runner(runner.module, torch.compile(runner.module, backend=compile_backend()), runner.form)


BUILDERS: dict[str, Callable[..., Runner]] = {
    "eager": build_eager,
    "eager_compiled": build_eager_compiled,
    "grouped_mm": build_grouped_mm,
    "liger": build_liger,
    "liger_tiled": build_liger_tiled,
    "deepspeed_tiled": build_deepspeed_tiled,
    "tiledmlp": build_tiledmlp,
    "tiledmlp_generic": build_tiledmlp_generic,
    "tiledmlp_fp32acc": build_tiledmlp_fp32acc,
    "tiledmlp_compiled": build_tiledmlp_compiled,
}
PROVIDER_IMPORTS = {  # provider -> (module, name it must define)
    "liger": ("liger_kernel.transformers.swiglu", "LigerSwiGLUMLP"),
    "liger_tiled": ("liger_kernel.transformers.tiled_mlp", "LigerTiledSwiGLUMLP"),
    "deepspeed_tiled": ("deepspeed.runtime.sequence_parallel.ulysses_sp", "TiledMLP"),
    "tiledmlp": ("tiledmlp", "enable_tiling"),
    "tiledmlp_generic": ("tiledmlp", "enable_tiling"),
    "tiledmlp_fp32acc": ("tiledmlp", "enable_tiling"),
    "tiledmlp_compiled": ("tiledmlp", "enable_tiling"),
}


def split_provider(name: str) -> tuple[str, Optional[int]]:
    """``"tiledmlp@16"`` -> ``("tiledmlp", 16)``; ``"eager"`` -> ``("eager", None)``."""
    base, _, shards = name.partition("@")
    if base not in BUILDERS or (shards and base != "tiledmlp"):
        raise SystemExit(f"unknown provider {name!r}; known: {', '.join(BUILDERS)} and tiledmlp@N")
    return base, int(shards) if shards else None


def check_importable(base: str) -> None:
    """Raise ImportError unless provider ``base``'s package and entry point import."""
    if base in PROVIDER_IMPORTS:
        module_name, attribute = PROVIDER_IMPORTS[base]
        if not hasattr(importlib.import_module(module_name), attribute):
            raise ImportError(f"{module_name} has no {attribute}")


def available_providers(names: list[str], device: torch.device, strict: bool) -> list[str]:
    """The providers that can run here; a missing one is an error when ``strict``, else a printed note."""
    usable = []
    for name in names:
        base, _ = split_provider(name)
        if base in TRITON_ONLY and device.type != "cuda":
            print(f"note: skipping {name}: Liger's kernels are Triton, which needs a GPU")
            continue
        try:
            check_importable(base)
        except ImportError as error:
            if strict:
                raise SystemExit(f"provider {name} cannot be imported ({error}); install the wheels in .whl/ "
                                 "(see benchmarks/README.md)") from error
            print(f"note: skipping {name}: {error}")
            continue
        usable.append(name)
    return usable


def build_runner(name: str, shape: Shape, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 tiledmlp_options: dict[str, Any]) -> Runner:
    """Construct provider ``name`` on the current default device, loaded with ``state``."""
    base, shards = split_provider(name)
    options = dict(tiledmlp_options)
    if shards is not None:
        options["num_shards"] = shards
    return BUILDERS[base](shape, state, dtype, options)


# --------------------------------------------------------------------------------------------------------------
# Measurements


def float64_reference(shape: Shape, state: dict[str, torch.Tensor], x: torch.Tensor, grad_out: torch.Tensor,
                      chunk_tokens: int) -> Reference:
    """Forward+backward in float64, ``chunk_tokens`` tokens at a time, weight grads accumulated by autograd."""
    with torch.device(x.device):
        module = materialize(eager_module(shape, experts_impl="eager"), state, torch.float64)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(out)
    for start in range(0, x.shape[-2], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        x_chunk = x[:, rows].detach().double().requires_grad_()
        y_chunk = module(x_chunk)
        y_chunk.backward(grad_out[:, rows].double())
        out[:, rows] = y_chunk.detach()
        dx[:, rows] = x_chunk.grad
    grads = {name: param.grad.float() for name, param in module.named_parameters() if param.requires_grad}
    return Reference(out, dx, grads)


def rel_l2(value: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 24) -> float:
    """``||value - ref|| / ||ref||`` in float64, a slice at a time so no full-size float64 copy exists."""
    value, ref = value.reshape(-1), ref.reshape(-1)
    num = torch.zeros((), dtype=torch.float64, device=ref.device)
    den = torch.zeros_like(num)
    for start in range(0, ref.numel(), chunk):
        r = ref[start:start + chunk].double()
        num += (value[start:start + chunk].double() - r).square().sum()
        den += r.square().sum()
    return math.sqrt(num.item() / max(den.item(), 1e-300))


def clear_grads(module: nn.Module, x: torch.Tensor) -> None:
    """Drop parameter and input gradients (set to None, as ``zero_grad()`` does)."""
    module.zero_grad(set_to_none=True)
    x.grad = None


def accuracy(runner: Runner, x: torch.Tensor, grad_out: torch.Tensor, ref: Reference) -> dict[str, float]:
    """Relative errors of the output, dx and every weight gradient; ``err_w_max`` is their maximum."""
    clear_grads(runner.module, x)
    out = runner.forward(x)
    out.backward(grad_out)
    errors = {"err_out": rel_l2(out.detach(), ref.out), "err_dx": rel_l2(x.grad, ref.dx)}
    for name, param in runner.module.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        errors[f"err_w:{name}"] = rel_l2(grad, ref.weight_grads[name])
    errors["err_w_max"] = max(v for k, v in errors.items() if k.startswith("err_w:"))
    clear_grads(runner.module, x)
    return errors


SETTLE_SECONDS = 1.0  # untimed work before timing, so the GPU is in its sustained (power-capped) state


def settle(fn: Callable[[], Any], runs: int, seconds: float) -> None:
    """Untimed ``fn()`` calls: at least ``runs``, and more until ``seconds`` have passed.

    A GPU at its power cap runs slower than a cold one (an H200 drops from its 1980 MHz boost clock
    to about 1500 MHz within a second of dense GEMMs), so a provider timed first, on a cold GPU,
    would look up to 15% faster than the ones after it. Settling times every provider in the
    sustained state a training run is in.
    """
    begin, done = time.perf_counter(), 0
    while done < runs or time.perf_counter() - begin < seconds:
        fn()
        done += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def cuda_median_ms(fn: Callable[[], Any], reps: int, warmup: int = 0, settle_seconds: float = SETTLE_SECONDS) -> float:
    """Median CUDA-event time of ``fn()`` over ``reps`` runs after ``warmup`` untimed ones (and
    ``settle_seconds`` of them, see :func:`settle`); each run is synchronized before the next starts."""
    settle(fn, warmup, settle_seconds)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def median_ms(fn: Callable[[], Any], on_gpu: bool, reps: int, warmup: int,
              settle_seconds: float = SETTLE_SECONDS) -> float:
    """Median time of ``fn()`` over ``reps`` runs after ``warmup`` untimed ones: CUDA events (and
    ``settle_seconds`` of settling, :func:`cuda_median_ms`) on a GPU, wall time on a CPU."""
    if on_gpu:
        return cuda_median_ms(fn, reps, warmup, settle_seconds)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def median_time_ms(runner: Runner, x: torch.Tensor, grad_out: torch.Tensor, warmup: int, reps: int,
                   settle_seconds: float = SETTLE_SECONDS) -> float:
    """Median time of forward+backward over ``reps`` runs after ``warmup`` runs and at least
    ``settle_seconds`` of untimed work on a GPU (CUDA events on a GPU)."""
    timer = gpu_times_ms if x.device.type == "cuda" else cpu_times_ms

    def run() -> None:
        clear_grads(runner.module, x)
        runner.forward(x).backward(grad_out)

    settle(run, warmup, settle_seconds if x.device.type == "cuda" else 0.0)
    times = timer(runner, x, grad_out, reps)
    clear_grads(runner.module, x)
    return statistics.median(times)


def gpu_times_ms(runner: Runner, x: torch.Tensor, grad_out: torch.Tensor, reps: int) -> list[float]:
    """Per-run forward+backward times from CUDA events, read after one synchronize at the end."""
    events = []
    for _ in range(reps):
        clear_grads(runner.module, x)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.forward(x).backward(grad_out)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def cpu_times_ms(runner: Runner, x: torch.Tensor, grad_out: torch.Tensor, reps: int) -> list[float]:
    """Per-run forward+backward wall times on the CPU."""
    times = []
    for _ in range(reps):
        clear_grads(runner.module, x)
        begin = time.perf_counter()
        runner.forward(x).backward(grad_out)
        times.append((time.perf_counter() - begin) * 1e3)
    return times


def peak_memory_mib(runner: Runner, x: torch.Tensor, grad_out: torch.Tensor) -> float:
    """Peak allocated memory of one forward+backward above what was allocated before it (inputs, weights)."""
    if x.device.type != "cuda":
        return float("nan")
    clear_grads(runner.module, x)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    runner.forward(x).backward(grad_out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    clear_grads(runner.module, x)
    return peak / 2**20


def measure(name: str, shape: Shape, state: dict[str, torch.Tensor], x: torch.Tensor, grad_out: torch.Tensor,
            ref: Optional[Reference], args: argparse.Namespace) -> dict[str, Any]:
    """All measurements of one provider at one sequence length."""
    with torch.device(x.device):
        runner = build_runner(name, shape, state, x.dtype, args.tiledmlp_options)
    result: dict[str, Any] = accuracy(runner, x, grad_out, ref) if ref is not None else {}
    if runner.form:
        result["form"] = runner.form
    result["time_ms"] = median_time_ms(runner, x, grad_out, args.warmup, args.reps, args.settle_seconds)
    result["peak_mib"] = peak_memory_mib(runner, x, grad_out)
    return result


def run_or_status(run: Callable[[], dict[str, Any]], cleanup: Callable[[], None],
                  columns: tuple[str, ...]) -> dict[str, Any]:
    """``run()``; if it runs out of memory or raises, ``columns`` all "oom" / "error" (the traceback
    printed), so one failing provider or variant does not hide the others' results. ``cleanup()`` always."""
    status = None
    try:
        return run()
    except torch.OutOfMemoryError:
        status = "oom"
    except Exception:
        traceback.print_exc()
        status = "error"
    finally:
        cleanup()
    return dict.fromkeys(columns, status)


def measure_or_record(name: str, shape: Shape, state: dict[str, torch.Tensor], x: torch.Tensor,
                      grad_out: torch.Tensor, ref: Optional[Reference], args: argparse.Namespace) -> dict[str, Any]:
    """:func:`measure`, with an out-of-memory or failing provider recorded as "oom" / "error"."""

    def cleanup() -> None:
        x.grad = None
        release_memory()

    row = run_or_status(lambda: measure(name, shape, state, x, grad_out, ref, args), cleanup,
                        ("time_ms", "peak_mib", "err_out", "err_dx", "err_w_max"))
    if isinstance(row["time_ms"], str):
        print(f"  {name}: {row['time_ms']}")
    return row


def reference_or_none(shape: Shape, state: dict[str, torch.Tensor], x: torch.Tensor, grad_out: torch.Tensor,
                      chunk_tokens: int) -> Optional[Reference]:
    """The float64 reference, or None (errors reported as "n/a") when it does not fit."""
    try:
        return float64_reference(shape, state, x, grad_out, chunk_tokens)
    except torch.OutOfMemoryError:
        print(f"note: float64 reference at T={x.shape[-2]} ran out of memory; errors are n/a")
        return None
    finally:
        release_memory()


def run_sequence_length(tokens: int, providers: list[str], shape: Shape, state: dict[str, torch.Tensor],
                        args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Measure every provider at one sequence length; returns one row (without metadata) per provider."""
    generator = torch.Generator(device=device).manual_seed(args.seed + tokens)
    x = torch.randn(1, tokens, shape.hidden, generator=generator, device=device).to(dtype).requires_grad_()
    grad_out = torch.randn(1, tokens, shape.hidden, generator=generator, device=device).to(dtype)
    ref = reference_or_none(shape, state, x, grad_out, args.ref_chunk)
    rows = []
    for name in providers:
        row = {"provider": name, "T": tokens, **measure_or_record(name, shape, state, x, grad_out, ref, args)}
        rows.append(row)
        print(f"  T={tokens:>7} {name:<16} time_ms={fmt(row['time_ms'])} peak_mib={fmt(row['peak_mib'])} "
              f"err_w_max={fmt(row.get('err_w_max', 'n/a'))}")
    add_time_ratios(rows)
    return rows


def add_time_ratios(rows: list[dict[str, Any]]) -> None:
    """Fill ``time_ratio_vs_eager`` (provider time / eager time at the same T)."""
    eager = next((r["time_ms"] for r in rows if r["provider"] == "eager"), None)
    for row in rows:
        numeric = isinstance(eager, float) and isinstance(row["time_ms"], float)
        row["time_ratio_vs_eager"] = row["time_ms"] / eager if numeric else "n/a"


# --------------------------------------------------------------------------------------------------------------
# Output


def fmt(value: Any) -> str:
    """Compact cell text: 4 significant digits for floats, text as is."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write rows with the fixed columns first, then the per-weight error columns."""
    write_csv_rows(path, rows, FIXED_COLUMNS)


def write_csv_rows(path: Path, rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    """Write rows with ``columns`` first, then any other keys (sorted); floats as :func:`fmt` writes them."""
    extra = sorted({key for row in rows for key in row} - set(columns))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*columns, *extra], restval="n/a")
        writer.writeheader()
        writer.writerows({key: fmt(value) if isinstance(value, float) else value for key, value in row.items()}
                         for row in rows)


def save_results(name: str, rows: list[dict[str, Any]], device: torch.device, args: argparse.Namespace,
                 columns: tuple[str, ...], printed: tuple[str, ...], packages: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rows with the device, versions of ``packages`` and date, written to ``args.out/<name>_<gpu>[_tag][_smoke].csv``
    and printed (``printed`` columns); returns them."""
    meta = {"gpu_name": gpu_name(device), "torch": torch.__version__, **{key: package_version(key) for key in packages},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    rows = [{**meta, **row} for row in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}_{gpu_slug(device)}" + (f"_{args.tag}" if args.tag else "") + ("_smoke" if args.smoke else "")
    write_csv_rows(args.out / f"{stem}.csv", rows, columns)
    print_rows(rows, printed)
    print(f"wrote {args.out / stem}.csv")
    return rows


def write_plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    """Time and peak memory against T (log-x), one line per provider (and style, when there are several);
    OOM/error points are left out."""
    several = len({row.get("style") for row in rows}) > 1
    rows = [{**row, "series": f"{row['provider']} [{row['style']}]" if several else row["provider"]} for row in rows]
    fig, axes = subplots(1, 2, (12, 4.5))
    for metric, axis, label in (("time_ms", axes[0][0], "forward+backward time (ms)"),
                                ("peak_mib", axes[0][1], "peak memory above inputs (MiB)")):
        plot_lines(axis, rows, metric, "series")
        format_tokens_axis(axis, sorted({row["T"] for row in rows}), "tokens T", label, log_y=True)
    save_figure(fig, path, title, dpi=120)


def subplots(rows: int, cols: int, size: tuple[float, float]) -> tuple[Any, Any]:
    """A matplotlib figure (headless backend) and its ``[rows][cols]`` axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=size, squeeze=False)


def save_figure(fig: Any, path: Path, title: str, dpi: int = 110) -> None:
    """Title, lay out, write and close ``fig``."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def plot_lines(axis: Any, rows: list[dict[str, Any]], metric: str, series: str) -> None:
    """One line of ``metric`` against ``T`` per value of ``rows[series]``; OOM/error/NaN points left out."""
    for name in dict.fromkeys(row[series] for row in rows):
        points = [(r["T"], r[metric]) for r in rows
                  if r[series] == name and isinstance(r[metric], float) and math.isfinite(r[metric])]
        if points:
            axis.plot(*zip(*points), marker="o", label=name)


def format_tokens_axis(axis: Any, tokens: list[int], xlabel: str, ylabel: str, log_y: bool) -> None:
    """A log2 token axis labelled 8K, 32K, ...; grid; legend when there are lines."""
    axis.set_xscale("log", base=2)
    if log_y:
        axis.set_yscale("log")
    axis.set_xticks(tokens, [f"{t // 1024}K" if t % 1024 == 0 else str(t) for t in tokens])
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.grid(True, which="both", alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8)


def print_table(rows: list[dict[str, Any]]) -> None:
    """Print the headline columns as an aligned text table."""
    print_rows(rows, ("provider", "style", "T", "time_ms", "time_ratio_vs_eager", "peak_mib", "err_out", "err_dx",
                      "err_w_max"))


def print_rows(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    """Print ``columns`` of ``rows`` as an aligned text table."""
    cells = [[fmt(row.get(c, "n/a")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    for line in ([*columns], *cells):
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))


# --------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command line; see the module docstring and benchmarks/README.md."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default=None, help="comma-separated token counts (default 8192,32768,131072)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size H (default 4096)")
    parser.add_argument("--intermediate", type=int, default=None, help="intermediate size I (default 14336)")
    parser.add_argument("--act", choices=sorted(ACTIVATIONS), default=None,
                        help="silu or gelu_tanh (default: silu; gelu_tanh for the plain and conv1d styles)")
    parser.add_argument("--style", default="act_fn",
                        help=f"comma-separated MLP styles to compare in one run: {', '.join(STYLES)} (default act_fn)")
    parser.add_argument("--lora", type=int, default=0,
                        help="rank of peft LoRA adapters on every projection, base weights frozen (default 0: none)")
    parser.add_argument("--moe", action="store_true", help="benchmark a Mixtral sparse MoE block instead")
    parser.add_argument("--experts", type=int, default=8, help="MoE: number of experts")
    parser.add_argument("--top-k", type=int, default=2, help="MoE: experts per token")
    parser.add_argument("--experts-impl", default="eager",
                        help="MoE: transformers experts implementation (eager, grouped_mm, batched_mm)")
    parser.add_argument("--providers", default=None, help="comma-separated; tiledmlp@N forces N shards")
    parser.add_argument("--tiledmlp-options", type=parse_options, default={},
                        help="extra enable_tiling keyword arguments, key=val,...")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before timing (after the accuracy run)")
    parser.add_argument("--reps", type=int, default=7, help="timed runs; the median is reported")
    parser.add_argument("--settle-seconds", type=float, default=SETTLE_SECONDS,
                        help="untimed work per provider before timing, so the GPU is at its sustained clocks")
    parser.add_argument("--ref-chunk", type=int, default=None, help="tokens per float64 reference chunk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--quick", "--smoke", action="store_true",
                        help="tiny smoke test (CPU float32 when no GPU); skips providers that cannot run")
    args = parser.parse_args(argv)
    apply_defaults(args)
    return args


def apply_defaults(args: argparse.Namespace) -> None:
    """Fill sizes left unset: full-size shapes, or tiny ones with ``--quick``."""
    full = {"seq_lens": "8192,32768,131072", "hidden": 4096, "intermediate": 14336, "ref_chunk": 8192}
    quick = {"seq_lens": "64,256", "hidden": 64, "intermediate": 160, "ref_chunk": 96}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.seq_lens = [int(t) for t in str(args.seq_lens).split(",")]
    args.styles = args.style.split(",")
    unknown = [style for style in args.styles if style not in STYLES]
    if unknown or (args.moe and args.styles != ["act_fn"]):
        raise SystemExit(f"unknown or MoE-incompatible --style {','.join(unknown) or args.style}; choose from "
                         f"{', '.join(STYLES)} (dense MLPs only)")
    if args.act is None:
        args.act = "gelu_tanh" if all(style in ("plain", "conv1d") for style in args.styles) else "silu"
    args.explicit_providers = args.providers is not None
    if args.lora and args.moe:
        raise SystemExit("--lora applies to dense MLPs only")
    default_providers = MOE_PROVIDERS if args.moe else LORA_PROVIDERS if args.lora else DENSE_PROVIDERS
    args.providers = args.providers.split(",") if args.providers else list(default_providers)
    if args.quick:
        args.warmup, args.reps = min(args.warmup, 1), min(args.reps, 3)
    elif args.warmup < 2 or args.reps < 5:
        raise SystemExit("use at least --warmup 2 and --reps 5 (or --quick)")


def output_stem(args: argparse.Namespace, device: torch.device) -> str:
    """``bench_mlp_<gpu>_<act>`` (``bench_moe_...`` with --moe; ``_<styles>`` for other styles than
    ``act_fn``, ``_H<hidden>`` for another hidden size than 4096, ``_lora<R>`` with LoRA adapters,
    ``_compile`` with compiled providers, ``..._quick`` with --quick)."""
    kind = "moe" if args.moe else "mlp"
    styles = "" if args.styles == ["act_fn"] else "_" + "-".join(args.styles)
    hidden = "" if args.hidden == 4096 or args.quick else f"_H{args.hidden}"
    compiled = "_compile" if any(p.endswith("_compiled") for p in args.providers) else ""
    lora = f"_lora{args.lora}" if args.lora else ""
    quick = "_quick" if args.quick else ""
    return f"bench_{kind}_{gpu_slug(device)}_{args.act}{styles}{hidden}{lora}{compiled}{quick}"


def main(argv: Optional[list[str]] = None) -> None:
    """Run every provider at every sequence length, then write the CSV and the plot and print a table."""
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    strict = args.explicit_providers and not args.quick
    providers = available_providers(args.providers, device, strict)
    rows = []
    for style in args.styles:
        shape = Shape(args.hidden, args.intermediate, args.act, style, args.moe, args.experts, args.top_k,
                      args.experts_impl, args.lora)
        usable = [name for name in providers if split_provider(name)[0] not in TRITON_ONLY or style in LIGER_STYLES]
        print(f"{gpu_name(device)}: {'MoE' if shape.moe else 'MLP'} {shape}, dtype {dtype}, providers {usable}")
        state = master_state_dict(shape, device, dtype, args.seed)
        for tokens in args.seq_lens:
            rows += [{"style": style, **row} for row in run_sequence_length(tokens, usable, shape, state, args, device,
                                                                            dtype)]

    meta = {"act": args.act, "hidden": args.hidden, "intermediate": args.intermediate,
            "dtype": str(dtype).removeprefix("torch."), "gpu_name": gpu_name(device), **package_versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    rows = [{**meta, **row} for row in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = output_stem(args, device)
    write_csv(args.out / f"{stem}.csv", rows)
    lora = f", LoRA r={args.lora}" if args.lora else ""
    block = "Mixtral MoE" if args.moe else f"MLP ({', '.join(args.styles)}{lora})"
    title = f"{gpu_name(device)} - {block} H={args.hidden} I={args.intermediate} {args.act} {meta['dtype']}"
    write_plot(args.out / f"{stem}.png", rows, title)
    print_table(rows)
    print(f"wrote {args.out / stem}.csv and .png")


if __name__ == "__main__":
    main()
