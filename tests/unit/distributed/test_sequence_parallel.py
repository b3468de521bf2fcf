"""Sequence parallelism seen from one process (``tiledmlp.distributed.sequence_parallel``): nothing is split without
a split; ``sequence_loss`` refuses what it cannot do; the gradient scale it picks per wrapper. The split itself
trains under torchrun (``tests/distributed/test_sp.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import tiledmlp
from tiledmlp.distributed.sequence_parallel import _summed_over_the_split, split_of
from unit_helpers import build


def test_an_unsplit_model_is_not_split():
    model = tiledmlp.enable_tiling(build("llama"))
    assert split_of(model) is None
    assert set(tiledmlp.tiled_modules(model).values()) == {"plain"}


def test_sequence_loss_needs_a_process_group():
    model = build("llama")
    ids = torch.randint(96, (1, 8))
    with pytest.raises(ValueError, match="needs torch.distributed initialized"):
        tiledmlp.sequence_loss(model, ids, input_ids=ids)


@pytest.mark.parametrize("engine, summed", [
    (SimpleNamespace(zero_optimization_stage=lambda: 1, sequence_parallel_size=2), True),
    (SimpleNamespace(zero_optimization_stage=lambda: 2, sequence_parallel_size=4), True),
    (SimpleNamespace(zero_optimization_stage=lambda: 3, sequence_parallel_size=2), False),
    (SimpleNamespace(zero_optimization_stage=lambda: 1, sequence_parallel_size=1), False),
    (torch.nn.Linear(2, 2), False),
    (None, False),
])
def test_which_wrappers_sum_over_the_split(engine, summed):
    """DeepSpeed's ZeRO-1/2 engines with Ulysses sum the ranks' gradients over the split (measured in
    tests/distributed/cases_sp.py); everything else averages over it."""
    assert _summed_over_the_split(engine) == summed
