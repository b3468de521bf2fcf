"""Host offload of checkpointed activations (``tiledmlp.offload``), on CPU: the mechanics — what is offloaded,
that everything comes back bit for bit, that nothing outside the chosen set is touched, buffer reuse across
steps — and the refusals. The overlapped CUDA path is exercised by ``test_cuda.py`` on a GPU."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tiledmlp
from tiledmlp.core.compat import checkpointing_method, enable_checkpointing
from tiledmlp.offload import host
from tiledmlp.offload.checkpointing import OffloadingCheckpointFunc, offloader_for
from tiledmlp.offload.host import HostOffload

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("fresh_offloaders")

HIDDEN, LAYERS, TOKENS = 64, 3, 40


def llama(reentrant: bool = False, checkpointing: bool = True) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=176,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).train()
    if checkpointing:
        enable_checkpointing(model, use_reentrant=reentrant)
    return model


def step(model: nn.Module, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor], object]:
    out = model(input_ids=ids, labels=ids, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads, out


def test_hf_llama_bit_identical_and_everything_comes_back():
    ids = torch.randint(128, (2, TOKENS), generator=torch.Generator().manual_seed(1))
    ref, got = llama(), llama()
    tiledmlp.enable_tiling(ref, loss=True, tile_tokens=16)
    tiledmlp.enable_tiling(got, loss=True, tile_tokens=16, offload="cpu")
    assert tiledmlp.offloaded_layers(got) == [f"model.layers.{i}" for i in range(LAYERS)]
    assert "checkpointed inputs of 3 layers offloaded to host" in tiledmlp.describe(got).summary()
    host = offloader_for(torch.device("cpu"))
    for k in range(2):
        loss_ref, grads_ref, out_ref = step(ref, ids, output_hidden_states=True)
        loss, grads, out = step(got, ids, output_hidden_states=True)
        assert torch.equal(loss, loss_ref)
        assert all(torch.equal(grads[n], grads_ref[n]) for n in grads_ref)
        # the caller's tensors (here the hidden states the model returns) are never the ones freed
        assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, out_ref.hidden_states))
        # every layer's input went out and came back; the second step reuses the first step's host buffers
        assert host.stats["regions"] == host.stats["restored"] == LAYERS * (k + 1)
        assert host.stats["host_buffers"] == LAYERS
        assert host.stats["offloaded_bytes"] == (k + 1) * LAYERS * 2 * TOKENS * HIDDEN * 4


def test_inputs_are_freed_between_forward_and_recompute():
    ids = torch.randint(128, (2, TOKENS), generator=torch.Generator().manual_seed(2))
    model = tiledmlp.enable_tiling(llama(), tile_tokens=16, offload="cpu")
    loss = model(input_ids=ids, labels=ids).loss
    host = offloader_for(torch.device("cpu"))
    regions = [ref() for ref in host._live]
    assert len(regions) == LAYERS
    assert all(t.untyped_storage().size() == 0 for r in regions for t in r.tensors)  # off the device
    params = {n: p.untyped_storage().size() for n, p in model.named_parameters()}
    loss.backward()
    assert all(r.restored for r in regions)
    assert all(p.untyped_storage().size() == params[n] for n, p in model.named_parameters())  # untouched


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return h + scale * self.down(F.gelu(self.up(self.norm(h))))


def custom_step(blocks: nn.ModuleList, x: torch.Tensor, ckpt) -> tuple[torch.Tensor, list[torch.Tensor]]:
    h, scale = x, torch.tensor(0.5)
    for block in blocks:
        h = ckpt(block, h, scale)
    loss = h.square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    return loss.detach(), grads


def test_custom_model_drop_in_checkpoint():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(4))
    x = torch.randn(2, TOKENS, HIDDEN, requires_grad=True)
    ref = custom_step(blocks, x, functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False))
    offloader_for(torch.device("cpu")).min_bytes = 1024  # the hidden states go, the 0-dim scale stays
    got = custom_step(blocks, x, tiledmlp.checkpoint)
    assert torch.equal(got[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
    stats = offloader_for(torch.device("cpu")).stats
    assert stats["regions"] == stats["restored"] == 4
    assert stats["offloaded_bytes"] == 4 * 2 * TOKENS * HIDDEN * 4


@pytest.mark.parametrize("mode", ["early", "late"])
def test_the_previous_region_comes_back_when_prefetch_says(mode, monkeypatch):
    """``prefetch="early"``: while a block recomputes, the previous block's inputs are already back; ``"late"``
    (the default): they start back only when this block's input gradient is computed. Bit-identical either way."""
    monkeypatch.setattr(HostOffload, "prefetch", mode)
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(4))
    x = torch.randn(2, TOKENS, HIDDEN, requires_grad=True)
    ref = custom_step(blocks, x, functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False))
    host = offloader_for(torch.device("cpu"))
    h, scale = x, torch.tensor(0.5)
    for block in blocks:
        h = tiledmlp.checkpoint(block, h, scale)
    regions = [ref() for ref in host._live]
    seen = []
    for k, block in enumerate(blocks):  # registered after the forward: these run in the recompute
        block.register_forward_pre_hook(lambda m, args, k=k: seen.append([r.restored for r in regions[:k + 1]]))
    h.square().mean().backward()
    got = [p.grad for p in blocks.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(got, ref[1]))
    # recompute order 3, 2, 1, 0: block k's own inputs are back, the previous block's as the mode says
    assert seen == [[False] * (k - 1) + [mode == "early"] * (k > 0) + [True] for k in (3, 2, 1, 0)]


def test_an_output_aliasing_the_input_keeps_it():
    x = torch.randn(4, HIDDEN, requires_grad=True)
    for _ in range(2):
        y = tiledmlp.checkpoint(lambda t: t.view_as(t), x * 1.0)
        y.sum().backward()
    assert torch.equal(x.grad, 2 * torch.ones_like(x))
    assert offloader_for(torch.device("cpu")).stats["host_buffers"] == 1  # its buffer went back to the pool


def _pool_is_consistent(offloader: HostOffload) -> None:
    """No host buffer is pooled twice, nor pooled while a region not yet restored holds it, nor held by two such
    regions: each would hand one region's input copy to another."""
    pooled = [h.data_ptr() for buffers in offloader._free.values() for h in buffers]
    held = [h.data_ptr() for r in (ref() for ref in offloader._live) if r is not None and not r.restored
            for h in r.hosts]
    assert len(set(pooled)) == len(pooled), "a buffer pooled twice"
    assert len(set(held)) == len(held), "a buffer held by two regions"
    assert not set(pooled) & set(held), "a buffer pooled while a region holds it"


def test_an_aliasing_region_then_regions_of_its_size_never_share_a_host_buffer():
    """A region whose output aliases its input gives that input's buffer back at once; three regions of the same size
    follow in the same step, the first taking that buffer. A buffer pooled twice (given back by the aliasing region
    and again when it is restored) would go to two of them, and the later one's copy would overwrite the earlier
    one's input: its recompute, and its gradients, would be another layer's. Checked: the pool's bookkeeping after
    every region and after backward, and the gradients bit for bit against plain checkpointing, over two steps."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(3))
    x = torch.randn(2, TOKENS, HIDDEN, requires_grad=True)

    def run(ckpt, check=lambda: None):
        h = ckpt(lambda t: t.view_as(t), x * 0.5)  # the output aliases the region's (cloned) input
        check()
        scale = torch.tensor(0.5)
        for block in blocks:
            h = ckpt(block, h, scale)
            check()
        h.square().mean().backward()
        grads = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        return grads

    ref = run(functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False))
    offloader = offloader_for(torch.device("cpu"))
    for _ in range(2):
        got = run(tiledmlp.checkpoint, lambda: _pool_is_consistent(offloader))
        _pool_is_consistent(offloader)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert offloader.stats["regions"] == 2 * 4 and offloader.stats["restored"] == 2 * 3
    sizes = {n: len(buffers) for n, buffers in offloader._free.items()}
    assert sizes == {2 * TOKENS * HIDDEN * 4: 3, 4: 3}, sizes  # a step's buffers, each pooled once, reused


def test_no_grad_offloads_nothing():
    with torch.no_grad():
        tiledmlp.checkpoint(lambda t: t * 2, torch.randn(4, HIDDEN))
    assert offloader_for(torch.device("cpu")).stats["regions"] == 0


@pytest.mark.parametrize("make, words", [
    (lambda: llama(checkpointing=False), ("no module", checkpointing_method(None), "tiledmlp.checkpoint")),
    (lambda: llama(reentrant=True), ("non-reentrant", "use_reentrant': False")),
])
def test_refused_without_non_reentrant_checkpointing(make, words):
    model = make()
    funcs = {n: m.__dict__.get("_gradient_checkpointing_func") for n, m in model.named_modules()}
    with pytest.raises(ValueError) as info:
        tiledmlp.enable_tiling(model, offload="cpu")
    assert all(w in str(info.value) for w in words), str(info.value)
    assert tiledmlp.tiled_modules(model) == {} and tiledmlp.offloaded_layers(model) == []
    assert all(m.__dict__.get("_gradient_checkpointing_func") is funcs[n] for n, m in model.named_modules())


def test_unknown_target_and_reentrant_drop_in_refused():
    with pytest.raises(ValueError, match="offload='gpu': choose None"):
        tiledmlp.enable_tiling(llama(), offload="gpu")
    with pytest.raises(ValueError, match="use_reentrant=False"):
        tiledmlp.checkpoint(lambda t: t, torch.randn(2, 2, requires_grad=True), use_reentrant=True)


def test_host_memory_too_small_is_refused_before_copying(monkeypatch):
    monkeypatch.setattr(host, "available_host_bytes", lambda: 1 << 30)
    model = tiledmlp.enable_tiling(llama(), offload="cpu")
    ids = torch.randint(128, (2, TOKENS))
    with pytest.raises(MemoryError, match="more host memory"):
        model(input_ids=ids, labels=ids)


def test_disable_restores_the_checkpoint_function():
    model = llama()
    before = model.model.layers[0]._gradient_checkpointing_func
    tiledmlp.enable_tiling(model, offload="cpu")
    assert isinstance(model.model.layers[0]._gradient_checkpointing_func, OffloadingCheckpointFunc)
    tiledmlp.enable_tiling(model)  # re-configured without offload
    assert model.model.layers[0]._gradient_checkpointing_func is before
    tiledmlp.enable_tiling(model, offload="cpu")
    tiledmlp.disable_tiling(model)
    assert model.model.layers[0]._gradient_checkpointing_func is before and tiledmlp.offloaded_layers(model) == []


class MLPBlock(nn.Module):
    """A residual block around a GLU MLP (recognized and tiled), as torchtitan's apply_ac wraps them."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.mlp = transformers.models.llama.modeling_llama.LlamaMLP(
            transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=176))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


def wrapped_stack(reentrant: bool = False) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    torch.manual_seed(0)
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    return nn.Sequential(*[checkpoint_wrapper(MLPBlock(), checkpoint_impl=impl) for _ in range(3)])


def test_torch_checkpoint_wrapper_layers_are_offloaded():
    """torch's ``checkpoint_wrapper`` (torchtitan's apply_ac): its ``checkpoint_fn`` gets the offload."""
    x = torch.randn(2, TOKENS, HIDDEN, requires_grad=True)
    grads = []
    for offload_to in (None, "cpu"):
        model = tiledmlp.enable_tiling(wrapped_stack(), tile_tokens=16, offload=offload_to)
        model(x).square().mean().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
        x.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert tiledmlp.offloaded_layers(model) == ["0", "1", "2"]
    stats = offloader_for(torch.device("cpu")).stats
    assert stats["regions"] == stats["restored"] == 3
    tiledmlp.disable_tiling(model)
    assert tiledmlp.offloaded_layers(model) == [] and not isinstance(model[0].checkpoint_fn,
                                                                      OffloadingCheckpointFunc)


def test_reentrant_checkpoint_wrapper_is_refused():
    with pytest.raises(ValueError, match="CheckpointImpl.NO_REENTRANT"):
        tiledmlp.enable_tiling(wrapped_stack(reentrant=True), offload="cpu")
