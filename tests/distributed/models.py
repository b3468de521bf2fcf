"""The models the torchrun cases train, built in one place: a Llama-shaped stand-in small enough that tiling cuts every
call into several uneven shards (:class:`TinyLM` and its blocks; :class:`MLPFirst`, whose MLP runs first), the MLPs a
case swaps in (``apply_tiled_mlp`` in a block or in the MLP's own forward, a toy MoE, the anchors' per-shard backward),
and Hugging Face models from tiny configs in code (:func:`tiny_llama`: a 2-layer Llama, 32 wide, 4 query and 2 KV heads,
vocabulary 96, eager attention, the same kernels on CPU and GPU; Mixtral, Qwen2-MoE, PEFT LoRA and QLoRA on it).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import tiledmlp
from tiledmlp.core.compat import enable_checkpointing

HIDDEN, INTER, VOCAB, LAYERS = 32, 88, 64, 2

TINY_LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                  attn_implementation="eager")
HF_VOCAB = TINY_LLAMA["vocab_size"]


# ----------------------------------------------------------------------------------------------
# A Llama-shaped stand-in


class GLUMLP(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """A decoder layer stand-in: a causal running mean over tokens in attention's place, then the MLP."""

    def __init__(self, mlp: Callable[[], nn.Module] = GLUMLP) -> None:
        super().__init__()
        self.mix_norm = nn.RMSNorm(HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.mlp_norm = nn.RMSNorm(HIDDEN)
        self.mlp = mlp()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = self.mix_norm(h)
        steps = torch.arange(1, z.shape[1] + 1, device=z.device, dtype=z.dtype)
        h = h + self.mix(z.cumsum(1) / steps[:, None])
        return h + self.call_mlp(self.mlp_norm(h))

    def call_mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


class TinyLM(nn.Module):
    """Embedding, ``LAYERS`` blocks, norm, head; ``forward(ids, labels)`` returns the LM loss.

    ``unused=True`` adds a module that forward never calls, for ``find_unused_parameters``.
    """

    def __init__(self, unused: bool = False, block: Callable[[], nn.Module] = Block) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.unused = nn.Linear(HIDDEN, HIDDEN) if unused else None

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class MLPFirst(nn.Module):
    """The MLP is the first op of forward, so its gradients are the last ones DDP's reducer waits for."""

    def __init__(self, mlp: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.mlp = mlp if mlp is not None else GLUMLP()
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.mlp(x)), y)


class ApplyBlock(Block):
    """A block that, once ``use_apply`` is set, calls its (unpatched) MLP through
    ``apply_tiled_mlp(fn, mlp, x, ddp_safe=True)``. The default ``fn`` calls the module, as Liger's and
    DeepSpeed's users write it."""

    use_apply = False

    @staticmethod
    def fn(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return mlp(x)

    def call_mlp(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_apply:
            return self.mlp(x)
        return tiledmlp.apply_tiled_mlp(self.fn, self.mlp, x, num_shards=3, ddp_safe=True)


class ForwardApplyBlock(ApplyBlock):
    """``fn`` computes with the MLP's forward, not its ``__call__`` (what FSDP2 units need)."""

    @staticmethod
    def fn(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return type(mlp).forward(mlp, x)


class ApplyInForwardMLP(GLUMLP):
    """Liger's pattern: the MLP's own forward calls ``apply_tiled_mlp`` on itself once ``use_apply``."""

    use_apply = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_apply:
            return super().forward(x)
        return tiledmlp.apply_tiled_mlp(GLUMLP.forward, self, x, num_shards=3)


def use_apply(model: nn.Module) -> None:
    """The tiling of the ``apply_tiled_mlp`` models: switch their modules to the functional form."""
    for m in model.modules():
        if hasattr(m, "use_apply"):
            m.use_apply = True


class InPlaceAfterMLPBlock(Block):
    """Scales the MLP's output in place. The tiled output is a view (FSDP2 warns about it); an in-place
    op on an FSDP2 unit's view output drops FSDP2's pre-backward hook, so nobody re-gathers the unit's
    parameters before the tiled node's backward: the strategy's own unshard has to."""

    def call_mlp(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(x)
        out *= 1.5
        return out


class ToyMoE(nn.Module):
    """Top-1 MoE with one module per expert (the pre-transformers-5 layout). A token goes to the expert
    of its first feature's band — (-inf, 0], (0, 1], (1, inf) — so which experts a rank uses, and which
    a shard uses, depends on the data."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, experts)
        self.experts = nn.ModuleList(GLUMLP() for _ in range(experts))
        self.register_buffer("bands", torch.tensor([0.0, 1.0]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights = self.gate(flat).softmax(-1)
        choice = torch.bucketize(flat[:, 0].contiguous(), self.bands)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(1)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * weights[rows, e:e + 1])
        return out.view_as(x)


class _PerShardBackward(torch.autograd.Function):
    """The anchors' tiled MLP (DeepSpeed TiledMLP, Liger): backward calls autograd.backward per shard."""

    @staticmethod
    def forward(ctx, mlp: GLUMLP, x: torch.Tensor, shards: int) -> torch.Tensor:
        ctx.mlp, ctx.shards = mlp, shards
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([GLUMLP.forward(mlp, s) for s in x.chunk(shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)
        for xs, gs, dxs in zip(x.chunk(ctx.shards, dim=-2), grad.chunk(ctx.shards, dim=-2),
                               dx.chunk(ctx.shards, dim=-2)):
            leaf = xs.detach().requires_grad_(True)
            with torch.enable_grad():
                out = GLUMLP.forward(ctx.mlp, leaf)
            torch.autograd.backward(out, gs)  # AccumulateGrad and DDP's hook run once per shard
            dxs.copy_(leaf.grad)
        return None, dx, None


class AnchorMLP(GLUMLP):
    """The anchors' mechanism once ``use_anchor`` is set (:func:`use_anchor`): the negative control."""

    use_anchor = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _PerShardBackward.apply(self, x, 4) if self.use_anchor else super().forward(x)


def use_anchor(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, AnchorMLP):
            m.use_anchor = True


# ----------------------------------------------------------------------------------------------
# Hugging Face models, tiny, from configs in code

MLP_PROJS = ["gate_proj", "up_proj", "down_proj"]
ATTENTION_PROJS = ["q_proj", "k_proj", "v_proj", "o_proj"]
#: the tiny Llama's shape for the other families (eager attention: the same kernels on CPU and GPU)
_SHAPE = {k: v for k, v in TINY_LLAMA.items() if k != "intermediate_size"}


def tiny_llama(**config: Any) -> LlamaForCausalLM:
    """A freshly initialised (torch's RNG as it stands) :data:`TINY_LLAMA`, ``config`` overriding its entries."""
    return LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **config}))


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                            router_jitter_noise=0.0, output_router_logits=False, **_SHAPE))


def qwen2_moe() -> nn.Module:
    """Shared expert (dense GLU) beside 4 routed experts; output_router_logits: the auxiliary loss trains
    the router through the routing weights' gradient (the MoE form's token input)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=40, shared_expert_intermediate_size=56,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                            output_router_logits=True, router_aux_loss_coef=0.1, **_SHAPE)
    config._experts_implementation = "grouped_mm"
    return Qwen2MoeForCausalLM(config)


def lora_llama() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=MLP_PROJS))


def _with_adapters(model: nn.Module, targets: list[str]) -> nn.Module:
    """peft LoRA (r=4) on ``targets``, its B nonzero (peft starts it at zero: A's gradient would be too)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    return model


def lora_llama_everywhere() -> nn.Module:
    """LoRA on the attention projections too (``projections=True`` tiles them)."""
    return _with_adapters(tiny_llama(), MLP_PROJS + ATTENTION_PROJS)


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


def uncached_llama() -> nn.Module:
    """No KV cache: a checkpoint around a layer's call would append the recompute's keys to it a second time."""
    model = tiny_llama()
    model.config.use_cache = False
    return model


def checkpointed_llama(attn_implementation: str = "eager") -> nn.Module:
    model = tiny_llama(attn_implementation=attn_implementation)
    enable_checkpointing(model)
    return model


def sdpa_checkpointed_llama() -> nn.Module:
    model = checkpointed_llama()
    model.config._attn_implementation = "sdpa"
    return model


def sdpa_llama() -> nn.Module:
    model = tiny_llama()
    model.config._attn_implementation = "sdpa"
    return model
