"""The torchrun suite as one matrix: each :class:`Case` is a row — a model and its tiling under one wrapper (a column:
``wrappers.py``, ``zero.py``) — with the strategy every tiled module must report and the checks its metrics must pass
(``checks.py``). Every case trains the model untiled and tiled from the same seed, under the same wrapper, and
compares (``Wrapper.run``; ``runs.py`` for the cases of their own kind). The cases of one launch run one after the
other in one torchrun world (``worker.py matrix:<launch>``); ``test_matrix.py`` runs each check as a test.

Reading a row: ``Case(name, wrapper, model, ...)``; the defaults are the tiny Llama-shaped LM, ``tile_tokens=16``
(every call cut into 5 to 9 uneven shards), SGD with momentum, one micro-batch per step, tiling after wrapping, the
wrapper's strategy, and the standard check (:data:`checks.MATCHES_UNTILED`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralExperts

import tiledmlp

from . import checks as c
from . import runs
from .common import CaseFn, Env, enable, mlp_only_loss
from .models import (ATTENTION_PROJS, AnchorMLP, ApplyBlock, ApplyInForwardMLP, Block, ForwardApplyBlock, GLUMLP,
                     InPlaceAfterMLPBlock, MLPFirst, TinyLM, ToyMoE, checkpointed_llama, lora_llama,
                     lora_llama_everywhere, mixtral, qlora_llama, qwen2_moe, sdpa_checkpointed_llama, sdpa_llama,
                     tiny_llama, uncached_llama, use_anchor, use_apply)
from .titan import BiasedMLP, Transformer, fused_glu
from .wrappers import FSDP1, LAUNCHES, TP, TP_LAUNCH, WORLD4, Launch, Model, Wrapper, ddp, fsdp2
from .zero import ZeRO, deepspeed_refusals, freeze_embeddings, zero3_enable_after_steps, zero3_prefetch_trace_stable
from .zero import TINY_LM as ENGINE_TINY_LM

#: a case's strategy is its wrapper's unless it says otherwise
WRAPPERS = "the wrapper's"


@dataclass(frozen=True)
class Case:
    """A row of the matrix. ``strategy``: what every tiled module reports (None: nothing is patched, the functional
    ``apply_tiled_mlp``); ``micro``: micro-batches per step (the wrapper's gradient accumulation); ``compiled``: each
    decoder block ``torch.compile``d before the wrapper (its graphs counted); ``bf16``: both runs in bf16, against
    an untiled float32 run; ``reference``: the untiled run under another wrapper; ``run``: a case of its own kind;
    ``launches``: where it runs, if not where its wrapper's cases run."""

    name: str
    wrapper: Wrapper
    model: Model = Model(TinyLM)
    checks: tuple[c.Check, ...] = (c.MATCHES_UNTILED,)
    strategy: Optional[str] = WRAPPERS
    tile: Callable[[nn.Module], None] = enable(tile_tokens=16)
    micro: int = 1
    tile_before_wrap: bool = False
    optimizer: str = "sgd"
    compiled: bool = False
    bf16: bool = False
    reference: Optional[Wrapper] = None
    run: Optional[Callable[[Case, Env], dict[str, Any]]] = None
    launches: tuple[Launch, ...] = ()

    @property
    def expected_strategy(self) -> Optional[str]:
        return self.wrapper.strategy if self.strategy == WRAPPERS else self.strategy

    @property
    def runs_in(self) -> tuple[Launch, ...]:
        return self.launches or self.wrapper.launches

    def metrics(self, env: Env) -> dict[str, Any]:
        """What each rank reports for this case."""
        return (self.run or self.wrapper.run)(self, env)


# ----------------------------------------------------------------------------------------------
# Models and tilings the rows name

TINY_LM_UNUSED = Model(functools.partial(TinyLM, unused=True))  # a module forward never calls
MLP_ALONE = Model.floats(GLUMLP, mlp_only_loss)  # the tiled MLP's parameters are all the wrapper has
MLP_FIRST = Model.floats(MLPFirst)  # the MLP's gradients are the last ones DDP's reducer waits for
MOE_FIRST = Model.floats(lambda: MLPFirst(ToyMoE()), experts_idle_on_rank0=True)
ANCHOR_FIRST = Model.floats(lambda: MLPFirst(AnchorMLP()),  # its input requires grad: else no grad_fn at all
                            loss_of=lambda m, b: m(b["x"].requires_grad_(True), b["y"]))
APPLY_LM = Model(functools.partial(TinyLM, block=ApplyBlock))  # apply_tiled_mlp(lambda m, x: m(x), mlp, x)
FORWARD_APPLY_LM = Model(functools.partial(TinyLM, block=ForwardApplyBlock))  # fn: the MLP's forward, not __call__
IN_FORWARD_APPLY_LM = Model(lambda: TinyLM(block=lambda: Block(mlp=ApplyInForwardMLP)))  # Liger's pattern
IN_PLACE_LM = Model(functools.partial(TinyLM, block=InPlaceAfterMLPBlock))

LLAMA = Model.hf(tiny_llama)
LLAMA_TIED = Model.hf(functools.partial(tiny_llama, tie_word_embeddings=True))
MIXTRAL = Model.hf(mixtral)
QWEN2_MOE = Model.hf(qwen2_moe)
LORA = Model.hf(lora_llama)
LORA_EVERYWHERE = Model.hf(lora_llama_everywhere)
CHECKPOINTED = Model.hf(checkpointed_llama)
CHECKPOINTED_SDPA = Model.hf(functools.partial(checkpointed_llama, "sdpa"))
SDPA_CHECKPOINTED = Model.hf(sdpa_checkpointed_llama)

TITAN = Model(Transformer)

#: the loss's scratch budget: 96 float32 logits a row, so 8 KiB (3/4 for logits) cuts ~16-token shards
LOSS_SCRATCH_MIB = 8 / 1024
#: attention=True's options: a scratch budget small enough that the tiny model's attention backward takes one KV head
#: per call (on CPU ranks; a GPU's float32 SDPA call is left to torch, said)
ATTENTION = dict(loss=True, norms=True, attention=True, scratch_mib=1e-4)


def tiled_loss(mode: str = "fused", **options: Any) -> Callable[[nn.Module], None]:
    """``loss=True`` with a small scratch budget, so the loss's call is cut into several shards too: ``fused`` finishes
    the head's gradients in forward (the default at real sizes), ``recompute`` chunks the vocabulary and recomputes
    the logits in backward."""
    return enable(loss=True, tile_tokens=16, loss_scratch_mib=LOSS_SCRATCH_MIB, loss_mode=mode, **options)


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


GENERIC = enable(tile_tokens=16, form="generic")
FORCED_NO_SYNC = enable(strategy="no_sync", tile_tokens=16)
LORA_TILED, QLORA_TILED = tile_lora(tile_tokens=16), tile_lora(quantized=True, tile_tokens=16)
LORA_LATE, PROJECTIONS_TILED = tile_before_adapters(tile_tokens=16), tile_projections(tile_tokens=16)
ENGINE_LOSS = enable(loss=True, tile_tokens=16)
OFFLOAD = enable(tile_tokens=16, offload="cpu")
OFFLOAD_NORMS = enable(tile_tokens=16, offload="cpu", loss=True, norms=True)
OFFLOAD_ATTENTION = enable(tile_tokens=16, offload="cpu", **ATTENTION)
ATTENTION_KEPT = (frozenset({"attention"}),) * 2  # both layers keep their attention output for their recompute

LAYERS, HEAD_UNIT = fsdp2(LlamaDecoderLayer), fsdp2(LlamaDecoderLayer, head_unit=True)
SYNCS_BY_ALL_REDUCE = c.syncs_on_last_micro_batch("ddp_bucket_all_reduce")
SYNCS_BY_REDUCE_SCATTER = c.syncs_on_last_micro_batch("reduce_scatter")
DDP_ACCUMULATES = (c.MATCHES_UNTILED, SYNCS_BY_ALL_REDUCE, c.LOCAL_GRADIENTS_COMPARED, c.SILENT_INSIDE_NO_SYNC)
FSDP1_ACCUMULATES = (c.MATCHES_UNTILED, SYNCS_BY_REDUCE_SCATTER, c.LOCAL_GRADIENTS_COMPARED)
ACCUMULATES = (c.MATCHES_UNTILED, SYNCS_BY_REDUCE_SCATTER)
LOSS_CHECKS = (c.MATCHES_UNTILED, c.HEAD_TILED)
ENGINE = (c.TRAINS_LIKE_UNTILED, c.gathers())
ENGINE_RECOMPUTES = (c.TRAINS_LIKE_UNTILED, c.gathers(at_most_once_in_backward=True))
TP_BOTH = (TP_LAUNCH, WORLD4)
BAD_PLANS = tuple(c.bad_plan(plan, *words) for plan, words in {
    "down_colwise": ("w2", "RowwiseParallel", "parallelize_module"),
    "up_rowwise": ("w3: RowwiseParallel", "ColwiseParallel"),
    "gate_up_differ": ("sharded differently", "w1", "w3", "input_layouts=S(1)"),
    "intermediate_replicated": ("Shard(-1)", "defaults"),
    "no_plan": ("DTensors", "no parallelize_module plan", "ColwiseParallel()"),
    "forced_plain": ("strategy='plain'", "strategy='tp'"),
    "generic_form": ("fast form", "form='generic' was asked for", "form='auto'"),
    "vocab_parallel_loss": ("loss=False", "loss_parallel"),
    "apply_tiled_mlp": ("tensor parallel", "once per shard", "enable_tiling"),
    "vocab_parallel_loss_tiled_before": ("lm_head is tensor parallel", "loss=False", "loss_parallel"),
}.items())


# ----------------------------------------------------------------------------------------------
# The matrix

MATRIX: tuple[Case, ...] = (
    # DDP: buckets of one parameter each, counted by a communication hook
    Case("ddp_compiled_blocks", ddp(default_buckets=True), compiled=True, tile_before_wrap=True,
         checks=(c.MATCHES_UNTILED, c.COMPILED_LIKE_UNTILED)),
    Case("ddp_default", ddp(), optimizer="adamw"),
    Case("ddp_find_unused_parameters", ddp(find_unused_parameters=True), TINY_LM_UNUSED),
    Case("ddp_static_graph", ddp(static_graph=True), checks=(c.MATCHES_UNTILED, c.SHARD_COUNT_CHANGES)),
    Case("ddp_gradient_as_bucket_view", ddp(gradient_as_bucket_view=True)),
    Case("ddp_mlp_params_only", ddp(), MLP_ALONE),
    Case("ddp_mlp_params_last", ddp(), MLP_FIRST),  # where the anchors' per-shard backward is silently wrong
    Case("ddp_tile_before_wrap", ddp(), tile_before_wrap=True),  # the strategy detected at run time
    Case("ddp_forced_plain_before_wrap_refused", ddp(), run=runs.refused_at_first_call,
         checks=(c.PLAIN_REFUSED_UNDER_DDP,)),
    Case("ddp_generic_form", ddp(), tile=GENERIC),
    Case("ddp_no_sync_accumulation", ddp(), micro=3, tile=FORCED_NO_SYNC, strategy="no_sync", checks=DDP_ACCUMULATES),
    Case("ddp_no_sync_tile_before_wrap", ddp(), micro=2, tile_before_wrap=True, checks=DDP_ACCUMULATES),
    Case("ddp_apply_tiled_mlp", ddp(), APPLY_LM, tile=use_apply, strategy=None),
    # experts idle on rank 0 and in many shards: each expert's gradient sums only the shards that routed to it
    Case("ddp_moe_experts_unused_on_a_rank", ddp(find_unused_parameters=True), MOE_FIRST),
    # untiled needs find_unused_parameters; tiled does not (the idle experts are inputs of the tiled node)
    Case("ddp_moe_experts_unused_without_find_unused", ddp(), MOE_FIRST, reference=ddp(find_unused_parameters=True),
         checks=(c.TRAINS_LIKE_UNTILED,)),
    Case("ddp_anchor_control", ddp(), ANCHOR_FIRST, tile=use_anchor, run=runs.anchor_control,
         checks=(c.ANCHOR_CAUGHT,)),
    Case("loss_ddp", ddp(), LLAMA, LOSS_CHECKS, tile=tiled_loss()),
    Case("loss_ddp_tied", ddp(), LLAMA_TIED, LOSS_CHECKS, tile=tiled_loss()),  # the tied weight's 2 gradients, once
    Case("loss_ddp_find_unused_parameters", ddp(find_unused_parameters=True), LLAMA, LOSS_CHECKS, tile=tiled_loss()),
    Case("loss_ddp_static_graph", ddp(static_graph=True), LLAMA_TIED, LOSS_CHECKS, tile=tiled_loss()),
    Case("loss_ddp_no_sync_accumulation", ddp(), LLAMA, (c.MATCHES_UNTILED, SYNCS_BY_ALL_REDUCE), micro=3,
         tile=tiled_loss(strategy="no_sync"), strategy="no_sync"),
    Case("loss_ddp_tile_before_wrap", ddp(), LLAMA, LOSS_CHECKS, tile=tiled_loss(), tile_before_wrap=True),
    Case("loss_ddp_recompute", ddp(), LLAMA_TIED, LOSS_CHECKS, tile=tiled_loss("recompute")),
    Case("hf_llama_ddp", ddp(), LLAMA),
    Case("hf_mixtral_ddp", ddp(), MIXTRAL),
    Case("hf_qwen2_moe_ddp_aux_loss", ddp(), QWEN2_MOE),
    Case("hf_qwen2_moe_ddp_no_sync", ddp(), QWEN2_MOE, micro=2),
    Case("hf_llama_ddp_offload_chain", ddp(), CHECKPOINTED, (c.chained(per_layer=1),), run=runs.chained()),
    Case("hf_llama_ddp_offload", ddp(), CHECKPOINTED, (c.offloaded(per_layer=1),), tile=OFFLOAD, run=runs.offloaded),
    # the million-token configuration: each norm's weight gradient reaches DDP's reducer once
    Case("hf_llama_ddp_offload_norms", ddp(), CHECKPOINTED, (c.offloaded(per_layer=3),), tile=OFFLOAD_NORMS,
         run=runs.offloaded),
    # a long-context step's: the attention core's backward in KV-head groups, q/k/v keeping the norm's input
    Case("hf_llama_ddp_offload_norms_attention", ddp(), SDPA_CHECKPOINTED, (c.offloaded(per_layer=3),),
         tile=OFFLOAD_ATTENTION, run=runs.offloaded),
    Case("hf_peft_lora_ddp", ddp(), LORA, tile=LORA_TILED),
    Case("hf_qlora_ddp", ddp(), Model.hf(qlora_llama()), tile=QLORA_TILED),  # 4-bit base weights, dequantized once
    Case("hf_peft_lora_projections_ddp", ddp(), LORA_EVERYWHERE, tile=PROJECTIONS_TILED),
    Case("hf_peft_lora_added_after_tiling_ddp", ddp(), LORA, tile=LORA_LATE, tile_before_wrap=True),
    Case("hf_peft_lora_ddp_tile_before_wrap", ddp(), LORA, tile=tile_lora(num_shards=3), tile_before_wrap=True),

    # FSDP1: flat parameters (the MLP's weights views of one) or original ones; unit at the root, layer or MLP
    Case("fsdp1_flat_root", FSDP1()),
    Case("fsdp1_flat_layer_units", FSDP1(Block), optimizer="adamw"),
    Case("fsdp1_flat_mlp_units", FSDP1(GLUMLP)),  # tiling patches the module inside the FSDP wrapper
    Case("fsdp1_orig_params_root", FSDP1(orig_params=True)),
    Case("fsdp1_orig_params_layer_units", FSDP1(Block, orig_params=True)),
    Case("fsdp1_orig_params_mlp_units", FSDP1(GLUMLP, orig_params=True)),
    Case("fsdp1_flat_tile_before_wrap", FSDP1(Block), tile_before_wrap=True),  # the flat views seen at run time
    Case("fsdp1_orig_params_tile_before_wrap", FSDP1(orig_params=True), tile_before_wrap=True),
    Case("fsdp1_no_sync_accumulation", FSDP1(Block), micro=3, tile=FORCED_NO_SYNC, strategy="no_sync",
         checks=FSDP1_ACCUMULATES),
    Case("fsdp1_no_sync_orig_params", FSDP1(GLUMLP, orig_params=True), micro=2, checks=FSDP1_ACCUMULATES),
    # from the decoder layer's forward (with flat parameters it is refused: test_detect.py)
    Case("fsdp1_apply_tiled_mlp_orig_params", FSDP1(Block, orig_params=True), FORWARD_APPLY_LM, tile=use_apply,
         strategy=None),
    Case("loss_fsdp1_flat", FSDP1(LlamaDecoderLayer), LLAMA, LOSS_CHECKS, tile=tiled_loss()),
    Case("loss_fsdp1_flat_tied", FSDP1(LlamaDecoderLayer), LLAMA_TIED, LOSS_CHECKS, tile=tiled_loss()),
    Case("loss_fsdp1_orig_params", FSDP1(LlamaDecoderLayer, orig_params=True), LLAMA_TIED, LOSS_CHECKS,
         tile=tiled_loss()),
    Case("loss_fsdp1_no_sync_accumulation", FSDP1(LlamaDecoderLayer), LLAMA, ACCUMULATES, micro=2, tile=tiled_loss()),
    Case("hf_llama_fsdp1_flat", FSDP1(LlamaDecoderLayer), LLAMA),
    # the flat views cannot be probed: tiled before wrapping, the experts keep the MoE form
    Case("hf_mixtral_fsdp1_tile_before_wrap", FSDP1(MixtralDecoderLayer), MIXTRAL, tile_before_wrap=True),
    # q/k/v's weights, views of the flat parameter, get their gradients from the projections that keep the norm's input
    Case("hf_llama_fsdp1_flat_attention", FSDP1(LlamaDecoderLayer), Model.hf(sdpa_llama),
         tile=enable(tile_tokens=16, **ATTENTION)),

    # FSDP2: the unit is the decoder layer, the MLP itself, or only the root
    Case("fsdp2_compiled_layer_units", fsdp2(Block), compiled=True, tile_before_wrap=True,  # torchtitan's order
         checks=(c.MATCHES_UNTILED, c.COMPILED_LIKE_UNTILED)),
    Case("fsdp2_layer_units", fsdp2(Block), optimizer="adamw"),
    # the host placement of an FSDP2 model's optimizer: AdamW, so the states follow the gradients exactly
    Case("fsdp2_cpu_offload_policy", fsdp2(Block, cpu_offload=True), optimizer="adamw"),
    Case("fsdp2_mlp_units", fsdp2(GLUMLP)),  # the unit's hooks run around the tiled forward, never inside backward
    Case("fsdp2_root_only", fsdp2()),
    Case("fsdp2_layer_units_keep_unsharded", fsdp2(Block, reshard_after_forward=False)),
    Case("fsdp2_mlp_units_keep_unsharded", fsdp2(GLUMLP, reshard_after_forward=False)),
    Case("fsdp2_tile_before_wrap_layer_units", fsdp2(Block), tile_before_wrap=True),
    Case("fsdp2_tile_before_wrap_mlp_units", fsdp2(GLUMLP), tile_before_wrap=True),
    Case("fsdp2_generic_form", fsdp2(GLUMLP), tile=GENERIC),
    Case("fsdp2_no_sync_accumulation", fsdp2(Block), micro=3, tile=FORCED_NO_SYNC, strategy="no_sync",
         checks=ACCUMULATES),  # set_requires_gradient_sync(False) on all but the last micro-batch
    Case("fsdp2_no_sync_mlp_units", fsdp2(GLUMLP), micro=2, checks=ACCUMULATES),
    # FSDP2's pre-backward hook dropped by an in-place op on the unit's output: the strategy re-gathers
    Case("fsdp2_in_place_on_mlp_unit_output", fsdp2(GLUMLP), IN_PLACE_LM),
    # apply_tiled_mlp on a unit, from its parent (the strategy gathers, forward and backward) or in its own forward
    Case("fsdp2_apply_tiled_mlp_outside_unit", fsdp2(GLUMLP), FORWARD_APPLY_LM, tile=use_apply, strategy=None),
    Case("fsdp2_apply_tiled_mlp_in_unit_forward", fsdp2(ApplyInForwardMLP), IN_FORWARD_APPLY_LM, tile=use_apply,
         strategy=None),
    Case("fsdp2_mixed_precision_layer_units", fsdp2(Block), bf16=True, checks=(c.WITHIN_BF16_NOISE,)),
    Case("fsdp2_mixed_precision_mlp_units", fsdp2(GLUMLP), bf16=True, checks=(c.WITHIN_BF16_NOISE,)),
    Case("loss_fsdp2_root_owns_head", LAYERS, LLAMA, LOSS_CHECKS, tile=tiled_loss()),
    Case("loss_fsdp2_root_owns_tied_head", LAYERS, LLAMA_TIED, LOSS_CHECKS, tile=tiled_loss()),
    # the loss runs after the head unit's own call: the strategy keeps it gathered until then (hold_gathered), the
    # untiled collectives, not one all-gather more
    Case("loss_fsdp2_head_unit", HEAD_UNIT, LLAMA, LOSS_CHECKS, tile=tiled_loss()),
    Case("loss_fsdp2_head_unit_keep_unsharded", fsdp2(LlamaDecoderLayer, head_unit=True, reshard_after_forward=False),
         LLAMA, LOSS_CHECKS, tile=tiled_loss()),
    Case("loss_fsdp2_head_unit_recompute", HEAD_UNIT, LLAMA, LOSS_CHECKS, tile=tiled_loss("recompute")),
    Case("loss_fsdp2_no_sync_accumulation", HEAD_UNIT, LLAMA, ACCUMULATES, micro=2, tile=tiled_loss()),
    Case("loss_fsdp2_tile_before_wrap", HEAD_UNIT, LLAMA, LOSS_CHECKS, tile=tiled_loss(), tile_before_wrap=True),
    Case("loss_fsdp2_mixed_precision_head_unit", HEAD_UNIT, LLAMA, (c.WITHIN_BF16_NOISE,), tile=tiled_loss(),
         bf16=True),
    Case("loss_fsdp2_mixed_precision_tied", LAYERS, LLAMA_TIED, (c.WITHIN_BF16_NOISE,), tile=tiled_loss(), bf16=True),
    Case("hf_llama_fsdp2", LAYERS, LLAMA),
    Case("hf_mixtral_fsdp2", fsdp2(MixtralDecoderLayer), MIXTRAL),
    Case("hf_mixtral_fsdp2_expert_units", fsdp2(MixtralExperts, MixtralDecoderLayer), MIXTRAL),
    # both layers' attention outputs kept for their recompute (a scratch budget small enough to group the tiny
    # model's calls; on CPU: a GPU's float32 leaves the call untouched, nothing kept)
    Case("hf_llama_fsdp2_offload_chain", LAYERS, CHECKPOINTED_SDPA, (c.chained(per_layer=3),),
         run=runs.chained(ATTENTION_KEPT, loss=True, norms=True, attention=True, scratch_mib=0.01)),
    Case("hf_llama_fsdp2_offload", LAYERS, CHECKPOINTED, (c.offloaded(per_layer=1),), tile=OFFLOAD,
         run=runs.offloaded),
    # the unit's __call__ checkpointed, its hooks included (transformers before 5.24 does it; this one no longer)
    Case("hf_llama_fsdp2_offload_hooks_in_checkpoint", fsdp2(checkpointed_units=True), Model.hf(uncached_llama),
         (c.offloaded(per_layer=3),), tile=OFFLOAD_NORMS, run=runs.offloaded),
    Case("hf_llama_fsdp2_offload_norms", LAYERS, CHECKPOINTED, (c.offloaded(per_layer=3),), tile=OFFLOAD_NORMS,
         run=runs.offloaded),
    Case("hf_llama_fsdp2_offload_norms_attention", LAYERS, SDPA_CHECKPOINTED, (c.offloaded(per_layer=3),),
         tile=OFFLOAD_ATTENTION, run=runs.offloaded),
    Case("hf_peft_lora_fsdp2", LAYERS, LORA, tile=LORA_TILED),
    # packed in float32 (bnb_4bit_quant_storage) so the units can shard them
    Case("hf_qlora_fsdp2", LAYERS, Model.hf(qlora_llama(torch.float32)),
         tile=QLORA_TILED),
    Case("hf_peft_lora_projections_fsdp2", LAYERS, LORA_EVERYWHERE, tile=PROJECTIONS_TILED),
    Case("hf_qlora_projections_fsdp2", LAYERS, Model.hf(qlora_llama(torch.float32, attention=True)),
         tile=tile_projections(quantized=True, tile_tokens=16)),
    Case("hf_peft_lora_added_after_tiling_fsdp2", LAYERS, LORA, tile=LORA_LATE, tile_before_wrap=True),

    # Tensor parallelism on torchtitan's model (titan.py): TP=2 over 2 processes, and TP=4 over 4
    Case("tp_sequence_parallel", TP(), TITAN, launches=TP_BOTH),
    Case("tp_replicated", TP(sequence_parallel=False), TITAN, (c.TRAINS_LIKE_UNTILED, c.REDUCES_GATE_AND_UP_ONCE),
         launches=TP_BOTH),
    Case("tp_tile_before_parallelize", TP(), TITAN, tile_before_wrap=True),
    Case("tp_biased_plain_mlp", TP(), Model(functools.partial(Transformer, BiasedMLP))),  # the bias before the reduce
    Case("tp_fused_gate_up", TP(), Model(functools.partial(Transformer, fused_glu))),  # Phi-3's, sharded as a whole
    Case("tp_forced_strategy", TP(), TITAN, tile=enable(strategy="tp", tile_tokens=16)),
    Case("tp_bf16", TP(), TITAN, (c.WITHIN_BF16_NOISE,), bf16=True),
    Case("tp_collectives_per_call", TP(), run=runs.tp_collectives_per_call,
         checks=(c.COLLECTIVES_PER_CALL, c.DESCRIBES_THE_LOCAL_SLICE), launches=TP_BOTH),
    Case("tp_bad_plans", TP(), run=runs.tp_bad_plans, checks=BAD_PLANS),

    # A world of 4: FSDP2 resharded to groups of 2 (its own option only from 4 ranks), HSDP as 2 "nodes" x 2, and
    # torchtitan's 2-D form, FSDP2 over TP (DP=2 x TP=2)
    Case("fsdp2_reshard_to_int", fsdp2(Block, reshard_after_forward=2, launches=(WORLD4,))),
    Case("fsdp2_hsdp", fsdp2(Block, replicas=2, launches=(WORLD4,)), optimizer="adamw"),
    Case("fsdp2_over_tp", TP(tp=2, launches=(WORLD4,)), TITAN),
    Case("fsdp2_over_tp_bf16", TP(tp=2, launches=(WORLD4,)), TITAN, (c.WITHIN_BF16_NOISE,), bf16=True),

    # DeepSpeed ZeRO 1/2/3 on 1 and 2 processes: every parameter's gathers counted, per micro-batch
    Case("zero1_tiny", ZeRO(1), ENGINE_TINY_LM, ENGINE, micro=2),
    Case("zero2_tiny", ZeRO(2), ENGINE_TINY_LM, ENGINE, micro=2),
    Case("zero3_tiny", ZeRO(3), ENGINE_TINY_LM, (*ENGINE, c.GATHERS_COUNTED), micro=2),
    Case("zero3_tile_before_initialize", ZeRO(3), ENGINE_TINY_LM, ENGINE, micro=2, tile_before_wrap=True),
    Case("zero2_tile_before_initialize", ZeRO(2), ENGINE_TINY_LM, ENGINE, micro=2, tile_before_wrap=True),
    Case("zero3_generic_form", ZeRO(3), ENGINE_TINY_LM, ENGINE, micro=2, tile=GENERIC),
    # DeepSpeed's TiledMLP call: fn calls the module, whose children carry ZeRO-3's hooks
    Case("zero3_apply_tiled_mlp", ZeRO(3), Model(functools.partial(TinyLM, block=ApplyBlock),
                                                 loss_of=ENGINE_TINY_LM.loss_of), ENGINE, micro=2, tile=use_apply,
         strategy=None),
    Case("zero3_hf_llama_loss_tied", ZeRO(3), LLAMA_TIED, ENGINE, micro=2, tile=ENGINE_LOSS),
    Case("zero2_hf_llama_loss_tied", ZeRO(2), LLAMA_TIED, ENGINE, micro=2, tile=ENGINE_LOSS),
    # the first layer's input needs no gradient; an untied head
    Case("zero3_hf_llama_frozen_embeddings", ZeRO(3, freeze=freeze_embeddings), LLAMA, ENGINE,
         tile=ENGINE_LOSS),
    # ZeRO's default leaf modules include Mixtral's sparse block: the strategy finds the experts' weights gathered
    Case("zero3_hf_mixtral", ZeRO(3), MIXTRAL, ENGINE),
    # ZeRO-Offload: the optimizer's step on the host, torch's AdamW there (DeepSpeed's CPU Adam would compile a C++ op)
    Case("zero2_offload_optimizer", ZeRO(2, {"offload_optimizer": {"device": "cpu"}},
                                         {"zero_force_ds_cpu_optimizer": False}),
         LLAMA, ENGINE, micro=2, tile=ENGINE_LOSS, optimizer="adamw"),
    Case("zero3_offload_optimizer_and_params", ZeRO(3, {"offload_optimizer": {"device": "cpu"},
                                                        "offload_param": {"device": "cpu"}},
                                                    {"zero_force_ds_cpu_optimizer": False}),
         LLAMA, ENGINE, micro=2, tile=ENGINE_LOSS, optimizer="adamw"),
    # frozen base weights: gathered for backward's recompute where the untiled backward kept the activations
    Case("zero3_hf_lora", ZeRO(3), LORA, ENGINE_RECOMPUTES, tile=LORA_TILED),
    Case("zero3_hf_qlora", ZeRO(3), Model.hf(qlora_llama()), ENGINE_RECOMPUTES, tile=QLORA_TILED),
    Case("zero3_hf_lora_projections", ZeRO(3), LORA_EVERYWHERE, ENGINE_RECOMPUTES, tile=PROJECTIONS_TILED),
    # planned again at the first call: the new adapters' partitioned parameters gathered for the probe once
    Case("zero3_hf_lora_added_after_tiling", ZeRO(3), LORA, tile=LORA_LATE, tile_before_wrap=True,
         checks=(c.TRAINS_LIKE_UNTILED, c.gathers(at_most_once_in_backward=True, probed_first=True))),
    Case("zero3_bf16", ZeRO(3), ENGINE_TINY_LM, (c.ENGINE_WITHIN_BF16_NOISE, c.gathers()), micro=2, bf16=True),
    Case("zero3_prefetch_trace_stable", ZeRO(3), run=zero3_prefetch_trace_stable, checks=(c.PREFETCH_TRACE_KEPT,)),
    Case("deepspeed_refusals", ZeRO(3), run=deepspeed_refusals, checks=(c.ENGINE_REFUSALS,)),
    Case("zero3_enable_after_steps", ZeRO(3), run=zero3_enable_after_steps, checks=(c.ENABLED_AFTER_STEPS,)),
)


def cases_of(launch: Launch) -> list[Case]:
    """The cases ``launch`` runs, in the matrix's order."""
    return [case for case in MATRIX if launch in case.runs_in]


def cases(launch_name: str) -> dict[str, CaseFn]:
    """What each rank of the launch named ``launch_name`` runs (``worker.py matrix:<name>``): case name -> run."""
    (launch,) = [launch for launch in LAUNCHES if launch.name == launch_name]

    def run(case: Case, env: Env) -> dict[str, Any]:
        if launch.nproc is not None and env.world != launch.nproc:
            raise ValueError(f"{case.name} runs on {launch.nproc} processes, got {env.world}")
        return case.metrics(env)

    return {case.name: functools.partial(run, case) for case in cases_of(launch)}
