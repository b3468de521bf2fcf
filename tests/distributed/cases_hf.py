"""Hugging Face cases, run by ``worker.py``: a Llama (GLU fast form), MoE models (Mixtral, and a Qwen2-MoE
with a shared expert and the router's auxiliary loss: the experts take the MoE form, the shared expert the
GLU form) and a PEFT-LoRA Llama (the GLU form with its adapters), each built from a tiny config in code
with random weights, under DDP (also no_sync accumulation), FSDP2 (layer units, and the experts as units
of their own) and FSDP1; and a checkpointed Llama with its layer inputs offloaded to host memory
(``offload="cpu"``, also with the loss and the normalization layers tiled) under DDP and FSDP2.
"""

from __future__ import annotations

import functools

from typing import Any, Callable

import tiledmlp
from tiledmlp.core.compat import enable_checkpointing
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralExperts

from cases_ddp import ddp
from cases_fsdp1 import fsdp1
from cases_fsdp2 import fsdp2
from common import Batch, Env, Recipe, ddp_sync, enable, hf_batches, registry, untiled_vs_tiled
from models import TINY_LLAMA, tiny_llama

CASES, case = registry()
VOCAB = TINY_LLAMA["vocab_size"]
#: the tiny Llama's shape for the other families (eager attention: the same kernels on CPU and GPU)
_SHAPE = {k: v for k, v in TINY_LLAMA.items() if k != "intermediate_size"}


def llama() -> nn.Module:
    return tiny_llama()


def mixtral() -> nn.Module:
    return MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                            router_jitter_noise=0.0, output_router_logits=False, **_SHAPE))


def qwen2_moe() -> nn.Module:
    """Shared expert (dense GLU) beside 4 routed experts; output_router_logits: the auxiliary loss trains
    the router through the routing weights' gradient (the MoE form's token input)."""
    config = Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=40, shared_expert_intermediate_size=56,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                            output_router_logits=True, router_aux_loss_coef=0.1, **_SHAPE)
    config._experts_implementation = "grouped_mm"
    return Qwen2MoeForCausalLM(config)


MLP_PROJS = ["gate_proj", "up_proj", "down_proj"]
ATTENTION_PROJS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def lora_llama() -> nn.Module:
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=MLP_PROJS)
    return get_peft_model(llama(), config)


def _with_adapters(model: nn.Module, targets: list[str]) -> nn.Module:
    """peft LoRA (r=4) on ``targets``, its B nonzero (peft starts it at zero: A's gradient would be too)."""
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    return model


def lora_llama_everywhere() -> nn.Module:
    """LoRA on the attention projections too (``projections=True`` tiles them)."""
    return _with_adapters(llama(), MLP_PROJS + ATTENTION_PROJS)


def qlora_llama(storage: torch.dtype = torch.uint8, attention: bool = False) -> Callable[[], nn.Module]:
    """QLoRA: a Llama whose MLP projections (and with ``attention`` its attention projections) are bitsandbytes 4-bit
    (nf4, double-quantized, float32 compute; packed in ``storage``, float32 for FSDP2, as ``bnb_4bit_quant_storage``
    does) with LoRA on them, the rest frozen."""
    attention_projs = ATTENTION_PROJS if attention else []

    def build() -> nn.Module:
        import bitsandbytes as bnb

        model = tiny_llama(intermediate_size=128, hidden_size=64)
        for layer in model.model.layers:
            for parent, name in [(layer.mlp, n) for n in MLP_PROJS] + [(layer.self_attn, n) for n in attention_projs]:
                lin = getattr(parent, name)
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.float32,
                                      quant_type="nf4", quant_storage=storage)
                q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                             quant_storage=storage, module=q)
                setattr(parent, name, q.to("cpu"))
        return _with_adapters(model, MLP_PROJS + attention_projs)
    return build


def tile_lora(quantized: bool = False, **options: Any) -> Callable[[nn.Module], None]:
    """``enable_tiling``, and a check that every MLP took the GLU form with its adapters (and 4-bit base weights)."""
    def tile(model: nn.Module) -> None:
        tiledmlp.enable_tiling(model, **options)
        infos = [i for i in tiledmlp.describe(model).values() if i.form != "loss"]  # the loss is tiled by default
        assert infos and all(i.form == "glu" and "LoRA adapters" in i.computes for i in infos), infos
        assert all(("4-bit nf4" in i.computes) == quantized for i in infos), infos
    return tile


def tile_before_adapters(**options: Any) -> Callable[[nn.Module], None]:
    """``enable_tiling`` on the model as it was before peft wrapped its projections (each LoRA layer's base layer in
    its place while tiling is enabled), then the adapters back: as ``enable_tiling`` then ``get_peft_model`` (TRL's
    ``SFTTrainer(peft_config=...)``). Every MLP's first call plans it again, with its adapters."""
    def tile(model: nn.Module) -> None:
        from peft.tuners.lora import LoraLayer

        places = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
                  if isinstance(child, LoraLayer)]
        for parent, name, child in places:
            setattr(parent, name, child.base_layer)
        tiledmlp.enable_tiling(model, **options)
        for parent, name, child in places:
            setattr(parent, name, child)
        infos = [i for i in tiledmlp.describe(model).values() if i.form != "loss"]
        assert infos and all("planned again at its next call" in i.fallback for i in infos), infos
    return tile


def tile_projections(quantized: bool = False, **options: Any) -> Callable[[nn.Module], None]:
    """``enable_tiling(projections=True)``, and a check that every MLP took the GLU form and every attention
    projection the fast projection form (4-bit or not)."""
    def tile(model: nn.Module) -> None:
        tiledmlp.enable_tiling(model, projections=True, **options)
        infos = tiledmlp.describe(model)
        projs = [i for i in infos.values() if i.form == "proj"]
        assert sorted(n.rsplit(".", 1)[-1] for n, i in infos.items() if i.form == "proj") == sorted(
            ATTENTION_PROJS * 2), infos
        assert all("backward recomputes only" in i.computes and ("4-bit" in i.computes) == quantized
                   for i in projs), projs
        assert sum(i.form == "glu" for i in infos.values()) == 2, infos
    return tile


def hf_loss(model: nn.Module, batch: Batch):
    return model(**batch).loss


def _recipe(env: Env, build: Callable[[], nn.Module], wrap: Callable[[nn.Module], nn.Module], **recipe: Any) -> Recipe:
    return Recipe(build=build, batches=hf_batches(env, VOCAB), wrap=wrap, loss_of=hf_loss, **recipe)


@case
def hf_llama_ddp(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, llama, ddp(env)), env)


@case
def hf_llama_fsdp2(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, llama, fsdp2(env, LlamaDecoderLayer)), env)


@case
def hf_llama_fsdp1_flat(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, llama, fsdp1(env, LlamaDecoderLayer, use_orig_params=False)), env)


@case
def hf_mixtral_ddp(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, mixtral, ddp(env)), env)


@case
def hf_mixtral_fsdp2(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, mixtral, fsdp2(env, MixtralDecoderLayer)), env)


@case
def hf_mixtral_fsdp1_tile_before_wrap(env: Env) -> dict[str, Any]:
    """FSDP1's flat-parameter views cannot be probed: tiled before wrapping, the experts keep the MoE form."""
    recipe = _recipe(env, mixtral, fsdp1(env, MixtralDecoderLayer, use_orig_params=False), tile_before_wrap=True)
    return untiled_vs_tiled(recipe, env)


@case
def hf_qwen2_moe_ddp_aux_loss(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, qwen2_moe, ddp(env)), env)


@case
def hf_qwen2_moe_ddp_no_sync(env: Env) -> dict[str, Any]:
    """Gradient accumulation over 2 micro-batches (DDP's no_sync on the first)."""
    recipe = Recipe(build=qwen2_moe, batches=hf_batches(env, VOCAB, micro=2), wrap=ddp(env), loss_of=hf_loss,
                    sync=ddp_sync)
    return untiled_vs_tiled(recipe, env)


def _experts_and_layer_units(env: Env) -> Callable[[nn.Module], nn.Module]:
    """fully_shard every experts module (a unit of its own), then every decoder layer, then the root."""
    mesh = init_device_mesh(env.device.type, (env.world,))

    def wrap(model: nn.Module) -> nn.Module:
        for unit in (MixtralExperts, MixtralDecoderLayer):
            for m in [m for m in model.modules() if isinstance(m, unit)]:
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    return wrap


@case
def hf_mixtral_fsdp2_expert_units(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, mixtral, _experts_and_layer_units(env)), env)


def uncached_llama() -> nn.Module:
    """No KV cache: a checkpoint around a layer's call would append the recompute's keys to it a second time."""
    model = llama()
    model.config.use_cache = False
    return model


def checkpointed_llama(attn_implementation: str = "eager") -> nn.Module:
    model = tiny_llama(attn_implementation=attn_implementation)
    enable_checkpointing(model)
    return model


def _offload_case(env: Env, wrap: Callable[[nn.Module], nn.Module], build: Callable[[], nn.Module] = checkpointed_llama,
                  **options: Any) -> dict[str, Any]:
    """Untiled checkpointed Llama against tiled + offloaded, under ``wrap``; reports the offloader's counts."""
    from tiledmlp.offload import checkpointing, host

    host.MIN_BYTES = 0  # the tiny model's layer inputs are a few KB: offload them all the same
    checkpointing._OFFLOADERS.clear()
    recipe = _recipe(env, build, wrap, tile=enable(tile_tokens=16, offload="cpu", **options))
    metrics = untiled_vs_tiled(recipe, env)
    stats = checkpointing.offloader_for(env.device).stats
    metrics.update(offload_regions=stats["regions"], offload_restored=stats["restored"])
    return metrics


class _Fixed:
    """A placement of the checkpointed layers' inputs decided in advance (what the memory plan would return), and what
    each layer keeps for its recompute."""

    def __init__(self, places: tuple[str, ...], keeps: tuple[frozenset[str], ...]) -> None:
        self.places, self.keeps = places, keeps

    def __call__(self, nbytes: int) -> tuple[tuple[str, ...], tuple[frozenset[str], ...]]:
        return self.places, self.keeps


def _chain_case(env: Env, wrap: Callable[[nn.Module], nn.Module], keeps: tuple[frozenset[str], ...] = (frozenset(),) * 2,
                build: Callable[[], nn.Module] = checkpointed_llama, **options: Any) -> dict[str, Any]:
    """``offload="auto"`` with layer 0's input on the host and layer 1's recomputed from it in backward (a recompute
    chain), each layer keeping ``keeps`` for its recompute, against the untiled checkpointed Llama; reports the inputs
    freed and rebuilt, and the attention outputs kept and reused."""
    from tiledmlp.offload import checkpointing, host

    host.MIN_BYTES = 0
    checkpointing._OFFLOADERS.clear()
    placements = []

    def tile(model: nn.Module) -> None:
        tiledmlp.enable_tiling(model, tile_tokens=16, offload="auto", **options)
        placement = checkpointing.layer_placement(model)
        placement.decide = _Fixed(("host", "recompute"), keeps)
        placements.append(placement)
        tiled.append(model)

    tiled: list[nn.Module] = []
    metrics = untiled_vs_tiled(_recipe(env, build, wrap, tile=tile), env)
    modes = [m.__dict__["_tiledmlp_attention_mode"] for m in tiled[-1].modules()
             if "_tiledmlp_attention_mode" in m.__dict__]
    metrics.update(freed=placements[-1].stats["freed"], rebuilt=placements[-1].stats["rebuilt"],
                   kept=sum(m.kept for m in modes), reused=sum(m.reused for m in modes))
    return metrics


@case
def hf_llama_ddp_offload_chain(env: Env) -> dict[str, Any]:
    return _chain_case(env, ddp(env))


@case
def hf_llama_fsdp2_offload_chain(env: Env) -> dict[str, Any]:
    """With the attention output of both layers kept for their recompute (``attention=True``, a scratch budget small
    enough to group the tiny model's calls; on CPU: a GPU's float32 leaves the call untouched, nothing kept)."""
    return _chain_case(env, fsdp2(env, LlamaDecoderLayer), keeps=(frozenset({"attention"}),) * 2,
                       build=functools.partial(checkpointed_llama, "sdpa"), loss=True, norms=True, attention=True,
                       scratch_mib=0.01)


@case
def hf_llama_ddp_offload(env: Env) -> dict[str, Any]:
    return _offload_case(env, ddp(env))


@case
def hf_llama_fsdp2_offload(env: Env) -> dict[str, Any]:
    return _offload_case(env, fsdp2(env, LlamaDecoderLayer))


def _units_checkpointed_with_their_hooks(env: Env) -> Callable[[nn.Module], nn.Module]:
    """fully_shard every decoder layer, then a non-reentrant ``checkpoint_wrapper`` around each unit, then the root:
    the checkpoint calls the unit's ``__call__``, its FSDP2 hooks included, in forward and again in the recompute
    — what transformers before 5.24 does with its own checkpointing (``partial(super().__call__)``), which the GPU
    image runs and this CPU suite's transformers no longer does."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    mesh = init_device_mesh(env.device.type, (env.world,))

    def wrap(model: nn.Module) -> nn.Module:
        layers = model.model.layers
        for i, layer in enumerate(layers):
            fully_shard(layer, mesh=mesh)
            layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        fully_shard(model, mesh=mesh)
        return model

    return wrap


@case
def hf_llama_fsdp2_offload_hooks_in_checkpoint(env: Env) -> dict[str, Any]:
    return _offload_case(env, _units_checkpointed_with_their_hooks(env), build=uncached_llama, loss=True, norms=True)


@case
def hf_llama_ddp_offload_norms(env: Env) -> dict[str, Any]:
    """The million-token configuration: loss, normalization layers and offload (each norm's weight gradient
    reaches DDP's reducer once)."""
    return _offload_case(env, ddp(env), loss=True, norms=True)


@case
def hf_llama_fsdp2_offload_norms(env: Env) -> dict[str, Any]:
    return _offload_case(env, fsdp2(env, LlamaDecoderLayer), loss=True, norms=True)


def sdpa_checkpointed_llama() -> nn.Module:
    model = checkpointed_llama()
    model.config._attn_implementation = "sdpa"
    return model


#: attention=True's options in the cases: a scratch budget small enough that the tiny model's attention backward
#: takes one KV head per call (on CPU ranks; a GPU's float32 SDPA call is left to torch, said)
ATTENTION = dict(loss=True, norms=True, attention=True, scratch_mib=1e-4)


@case
def hf_llama_ddp_offload_norms_attention(env: Env) -> dict[str, Any]:
    """The per-token configuration of a long-context step: loss, norms, offload, and the attention core's backward
    in KV-head groups with q/k/v keeping the input norm's input (``tiledmlp.attention``)."""
    return _offload_case(env, ddp(env), build=sdpa_checkpointed_llama, **ATTENTION)


@case
def hf_llama_fsdp2_offload_norms_attention(env: Env) -> dict[str, Any]:
    return _offload_case(env, fsdp2(env, LlamaDecoderLayer), build=sdpa_checkpointed_llama, **ATTENTION)


def sdpa_llama() -> nn.Module:
    model = llama()
    model.config._attn_implementation = "sdpa"
    return model


@case
def hf_llama_fsdp1_flat_attention(env: Env) -> dict[str, Any]:
    """``attention=True`` under FSDP1's flat parameters: q/k/v's weights, views of the flat parameter, get their
    gradients from the projections that keep the norm's input."""
    wrap = fsdp1(env, LlamaDecoderLayer, use_orig_params=False)
    return untiled_vs_tiled(_recipe(env, sdpa_llama, wrap, tile=enable(tile_tokens=16, **ATTENTION)), env)


@case
def hf_peft_lora_ddp(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, lora_llama, ddp(env), tile=tile_lora(tile_tokens=16)), env)


@case
def hf_peft_lora_fsdp2(env: Env) -> dict[str, Any]:
    return untiled_vs_tiled(_recipe(env, lora_llama, fsdp2(env, LlamaDecoderLayer), tile=tile_lora(tile_tokens=16)),
                            env)


@case
def hf_qlora_ddp(env: Env) -> dict[str, Any]:
    """4-bit base weights (dequantized once per pass in the GLU form) and LoRA under DDP."""
    return untiled_vs_tiled(_recipe(env, qlora_llama(), ddp(env), tile=tile_lora(quantized=True, tile_tokens=16)),
                            env)


@case
def hf_qlora_fsdp2(env: Env) -> dict[str, Any]:
    """Under FSDP2, packed in float32 (bnb_4bit_quant_storage) so the units can shard them: the strategy reads the
    unsharded packed bytes, the quantization state from the layer."""
    recipe = _recipe(env, qlora_llama(torch.float32), fsdp2(env, LlamaDecoderLayer),
                     tile=tile_lora(quantized=True, tile_tokens=16))
    return untiled_vs_tiled(recipe, env)


@case
def hf_peft_lora_projections_ddp(env: Env) -> dict[str, Any]:
    """LoRA on attention and MLP, ``projections=True``: each adapted projection's gradients reach DDP once."""
    return untiled_vs_tiled(_recipe(env, lora_llama_everywhere, ddp(env), tile=tile_projections(tile_tokens=16)), env)


@case
def hf_peft_lora_projections_fsdp2(env: Env) -> dict[str, Any]:
    recipe = _recipe(env, lora_llama_everywhere, fsdp2(env, LlamaDecoderLayer), tile=tile_projections(tile_tokens=16))
    return untiled_vs_tiled(recipe, env)


@case
def hf_qlora_projections_fsdp2(env: Env) -> dict[str, Any]:
    """QLoRA with 4-bit attention projections tiled too, under FSDP2 (packed in float32)."""
    recipe = _recipe(env, qlora_llama(torch.float32, attention=True), fsdp2(env, LlamaDecoderLayer),
                     tile=tile_projections(quantized=True, tile_tokens=16))
    return untiled_vs_tiled(recipe, env)


@case
def hf_peft_lora_added_after_tiling_ddp(env: Env) -> dict[str, Any]:
    """Tiled before peft added the adapters (then DDP): each MLP planned again at its first call, on every rank."""
    recipe = _recipe(env, lora_llama, ddp(env), tile_before_wrap=True, tile=tile_before_adapters(tile_tokens=16))
    return untiled_vs_tiled(recipe, env)


@case
def hf_peft_lora_added_after_tiling_fsdp2(env: Env) -> dict[str, Any]:
    recipe = _recipe(env, lora_llama, fsdp2(env, LlamaDecoderLayer), tile_before_wrap=True,
                     tile=tile_before_adapters(tile_tokens=16))
    return untiled_vs_tiled(recipe, env)


@case
def hf_peft_lora_ddp_tile_before_wrap(env: Env) -> dict[str, Any]:
    recipe = _recipe(env, lora_llama, ddp(env), tile_before_wrap=True, tile=tile_lora(num_shards=3))
    return untiled_vs_tiled(recipe, env)
