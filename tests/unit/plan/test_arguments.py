"""Every public entry point checks the memory options the same way (``tiledmlp.plan.arguments``): a bad value is a
TypeError or ValueError naming the option, never planned, tiled or taken as True in silence. Each case below was
accepted, or failed with an unrelated error, before the checks were one."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import tiledmlp
from tiledmlp import plan_memory

from unit_helpers import batch, checkpointed_llama, rel_err

#: (options, the error, words it must contain: the option's name and what it takes)
BAD_MEMORY_OPTIONS = [
    ({"gpu_mib": -1}, ValueError, "gpu_mib must be a finite number of MiB >= 0"),
    ({"gpu_mib": "1G"}, TypeError, "gpu_mib must be a number of MiB"),
    ({"host_mib": math.nan}, ValueError, "host_mib must be a finite number of MiB >= 0"),
    ({"gpu_mib": math.inf}, ValueError, "gpu_mib must be a finite number"),
    ({"gpu_mib": True}, TypeError, "gpu_mib must be a number of MiB"),
    ({"norms": "x"}, TypeError, "norms must be True or False"),
    ({"attention": 1}, TypeError, "attention must be True or False"),
    ({"projections": None}, TypeError, "projections must be True or False"),
    ({"loss": "yes"}, TypeError, "loss must be None"),
    ({"offload": "gpu"}, ValueError, "offload='gpu': choose None"),
    ({"loss_scratch_mib": 0}, ValueError, "loss_scratch_mib must be a positive number"),
    ({"scratch_mib": "64"}, TypeError, "scratch_mib must be a positive number"),
    ({"optimizer": "adam"}, ValueError, "optimizer 'adam': tiledmlp plans ['adamw'"),
    ({"optimizer": torch.optim.AdamW}, TypeError, "optimizer must be None, a torch.optim.Optimizer or one of"),
    ({"optimizer": "adamw", "optimizer_placement": "disk"}, ValueError, "optimizer_placement='disk': choose one of"),
    ({"optimizer_placement": "gpu"}, ValueError, "optimizer_placement='gpu' places the optimizer given"),
    ({"loss": False, "loss_scratch_mib": 64}, ValueError, "loss_scratch_mib set(s) the tiled loss, which loss=False"),
]


def _name(case) -> str:
    return ",".join(f"{k}={v!r}" for k, v in case[0].items())


@pytest.mark.parametrize("options, error, words", BAD_MEMORY_OPTIONS, ids=map(_name, BAD_MEMORY_OPTIONS))
def test_plan_memory_refuses_bad_memory_options(options, error, words):
    with pytest.raises(error, match=re.escape(words)):
        plan_memory(checkpointed_llama(layers=2), 4096, **options)


@pytest.mark.parametrize("options, error, words", BAD_MEMORY_OPTIONS, ids=map(_name, BAD_MEMORY_OPTIONS))
def test_enable_tiling_refuses_the_same_values_and_leaves_the_model_untiled(options, error, words):
    model = checkpointed_llama(layers=2)
    with pytest.raises(error, match=re.escape(words)):
        tiledmlp.enable_tiling(model, **options)
    assert tiledmlp.tiled_modules(model) == {}


@pytest.mark.parametrize("arguments, words", [
    ({"seq_len": 0}, "seq_len must be a positive int"),
    ({"seq_len": 4096.0}, "seq_len must be a positive int"),
    ({"seq_len": 4096, "batch_size": 0}, "batch_size must be a positive int"),
    ({"seq_len": 4096, "sequence_parallel": 1.5}, "sequence_parallel must be a positive int"),
    ({"seq_len": 4097, "sequence_parallel": 2}, "must split evenly over the 2 sequence-parallel ranks"),
])
def test_plan_memory_refuses_bad_lengths(arguments, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        plan_memory(checkpointed_llama(layers=2), **arguments)


@pytest.mark.parametrize("options, error, words", [
    ({"include_moe": "no"}, TypeError, "include_moe must be True or False"),
    ({"mlp_types": nn.Linear}, TypeError, "(a class itself: pass [Linear])"),
    ({"mlp_types": [nn.Linear, "LlamaMLP"]}, TypeError, "mlp_types must be a list of nn.Module subclasses"),
    ({"loss": False, "loss_mode": "fused"}, ValueError, "loss_mode set(s) the tiled loss, which loss=False turns off"),
])
def test_enable_tiling_refuses_bad_tiling_options(options, error, words):
    model = checkpointed_llama(layers=2)
    with pytest.raises(error, match=re.escape(words)):
        tiledmlp.enable_tiling(model, **options)
    assert tiledmlp.tiled_modules(model) == {}


def test_the_loss_options_at_their_defaults_go_with_loss_false():
    """A launcher that passes every option (``launch/train.py``) passes the loss's at their defaults: not refused."""
    model = tiledmlp.enable_tiling(checkpointed_llama(layers=2), loss=False, loss_mode="auto", loss_scratch_mib=None,
                                   loss_grad_accum_dtype=torch.float32)
    assert tiledmlp.tiled_modules(model) and "loss" not in {i.form for i in tiledmlp.describe(model).values()}


def test_include_moe_false_and_mlp_types_as_a_tuple_are_still_taken():
    """The checks refuse only what is wrong: the values the options take still tile (and train exactly)."""
    untiled = checkpointed_llama(layers=2)
    tiled = tiledmlp.enable_tiling(checkpointed_llama(layers=2), include_moe=False, mlp_types=(nn.Identity,),
                                   loss=False)
    tiled.load_state_dict(untiled.state_dict())
    ids = batch(vocab=untiled.config.vocab_size)
    assert tiledmlp.tiled_modules(tiled)  # the MLPs are tiled
    assert rel_err(tiled(ids, labels=ids).loss, untiled(ids, labels=ids).loss) < 1e-6


@pytest.mark.parametrize("num_items, error", [
    (0, ValueError), (-3, ValueError), (torch.tensor(0), ValueError), (torch.tensor(-1.0), ValueError),
    (math.nan, ValueError), (True, TypeError), ("8", TypeError), (torch.tensor([4, 4]), TypeError),
])
def test_the_tiled_loss_refuses_a_count_that_is_not_positive(num_items, error):
    """Untiled, 0 gives inf (or NaN), a negative count a negative loss: no error, a ruined step. Tiled: refused."""
    x, w = torch.randn(2, 8, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    labels = torch.randint(0, 40, (2, 8))
    with pytest.raises(error, match="num_items_in_batch must be"):
        tiledmlp.tiled_linear_cross_entropy(x, w, labels, reduction="sum", num_items_in_batch=num_items)


def test_the_tiled_loss_takes_a_positive_count_as_a_tensor_or_a_number():
    x, w = torch.randn(2, 8, 16, dtype=torch.float64), torch.randn(40, 16, dtype=torch.float64)
    labels = torch.randint(0, 40, (2, 8))
    summed = torch.nn.functional.cross_entropy(x.reshape(-1, 16) @ w.T, labels.reshape(-1), reduction="sum")
    for count in (7, 7.0, torch.tensor(7), torch.tensor([7.0])):
        got = tiledmlp.tiled_linear_cross_entropy(x, w, labels, reduction="sum", num_items_in_batch=count)
        assert torch.allclose(got, summed / 7, rtol=1e-12)


@pytest.mark.parametrize("scale", [0, 0.0, math.inf, math.nan])
def test_the_tiled_loss_refuses_a_logit_scale_that_is_zero_or_not_finite(scale):
    x, w = torch.randn(2, 8, 16), torch.randn(40, 16)
    with pytest.raises(ValueError, match="logit scale must be a finite nonzero number"):
        tiledmlp.tiled_linear_cross_entropy(x, w, torch.randint(0, 40, (2, 8)), logit_scale=scale)
