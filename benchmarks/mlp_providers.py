"""The MLP blocks and providers ``bench_mlp.py`` measures: the block's shape (:class:`Shape`), the untiled modules
of each style (transformers' ``LlamaMLP``, an inline GLU, torchtitan's ``FeedForward``, Phi-2's and GPT-2's MLPs,
Mixtral's sparse MoE block; peft LoRA adapters on them), the weights every provider loads, and one builder per
provider (eager, Liger's, DeepSpeed's ``TiledMLP``, tiledmlp's forms, compiled), each returning a :class:`Runner`.
What is measured lives here; how it is timed is ``bench_mlp.py``'s, how it is written ``reporting.py``'s.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}
DENSE_PROVIDERS = ("eager", "liger", "liger_tiled", "deepspeed_tiled", "tiledmlp", "tiledmlp_fp32acc")
STYLES = ("act_fn", "inline", "torchtitan", "plain", "conv1d")
LIGER_STYLES = ("act_fn", "inline")  # Liger's GLU modules load these styles' weights (same names)
LORA_PROVIDERS = ("eager", "tiledmlp", "tiledmlp_generic")
MOE_PROVIDERS = ("eager", "grouped_mm", "deepspeed_tiled", "tiledmlp")
TRITON_ONLY = frozenset({"liger", "liger_tiled"})


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
