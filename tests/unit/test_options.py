"""``tiledmlp.TilingOptions``: every option of ``enable_tiling`` in one object, the one list of their names, checked
once when it is made (each error naming the field), taken by ``enable_tiling`` and ``plan_memory`` as the keywords
are, and read back from a tiled model through one accessor."""

from __future__ import annotations

import ast
import copy
import dataclasses
import pickle
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import tiledmlp
from tiledmlp import TilingOptions, plan_memory, tiling_options_of
from tiledmlp.plan.options import OPTION_NAMES

from unit_helpers import assert_identical, checkpointed_llama, train_exactly

PACKAGE = Path(tiledmlp.__file__).resolve().parent


def option_name_lists(source: str) -> list[str]:
    """The tuple, list and set literals in ``source`` of three or more strings that are all option names: a list of
    option names written out by hand, which must be derived from :class:`TilingOptions`' fields instead."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 3:
            if all(isinstance(e, ast.Constant) and e.value in OPTION_NAMES for e in node.elts):
                found.append(ast.unparse(node))
    return found


def test_the_option_names_are_the_fields():
    assert OPTION_NAMES == tuple(f.name for f in dataclasses.fields(TilingOptions) if f.init)
    assert len(OPTION_NAMES) == len(set(OPTION_NAMES)) == 22


def test_the_scan_finds_a_hand_written_list():
    assert option_name_lists('KEYS = ("norms", "attention", "offload")\nx = ["seq_len", "gpu_mib", "host_mib"]') \
        == ["('norms', 'attention', 'offload')", "['seq_len', 'gpu_mib', 'host_mib']"]
    assert option_name_lists('KEYS = ("norms", "attention", "something else")\nx = ("gpu_mib", "host_mib")') == []


def test_no_other_hand_written_list_of_option_names():
    found = {str(p.relative_to(PACKAGE)): names for p in sorted(PACKAGE.rglob("*.py"))
             if (names := option_name_lists(p.read_text()))}
    assert not found, f"option names written out by hand (derive them from tiledmlp.plan.options): {found}"


@pytest.mark.parametrize("options, error, field", [
    ({"strategy": "ddpp"}, ValueError, "strategy"),
    ({"num_shards": 0}, ValueError, "num_shards"),
    ({"num_shards": 2, "tile_tokens": 8}, ValueError, "num_shards or tile_tokens"),
    ({"loss": "yes"}, TypeError, "loss"),
    ({"tile_tokens": -1}, ValueError, "tile_tokens"),
    ({"inter_chunks": 0}, ValueError, "inter_chunks"),
    ({"scratch_mib": "64"}, TypeError, "scratch_mib"),
    ({"form": "fast"}, ValueError, "form"),
    ({"grad_accum_dtype": torch.int32}, TypeError, "grad_accum_dtype"),
    ({"mlp_types": nn.Linear}, TypeError, "mlp_types"),
    ({"include_moe": "no"}, TypeError, "include_moe"),
    ({"loss_scratch_mib": 0}, ValueError, "loss_scratch_mib"),
    ({"loss_mode": "chunked"}, ValueError, "loss_mode"),
    ({"loss_grad_accum_dtype": "float32"}, TypeError, "loss_grad_accum_dtype"),
    ({"loss": False, "loss_mode": "fused"}, ValueError, "loss_mode"),
    ({"offload": "gpu"}, ValueError, "offload"),
    ({"norms": None}, TypeError, "norms"),
    ({"projections": 1}, TypeError, "projections"),
    ({"attention": "yes"}, TypeError, "attention"),
    ({"gpu_mib": -1}, ValueError, "gpu_mib"),
    ({"host_mib": "1G"}, TypeError, "host_mib"),
    ({"seq_len": 0}, ValueError, "seq_len"),
    ({"optimizer": "adam"}, ValueError, "optimizer"),
    ({"optimizer": "adamw", "optimizer_placement": "disk"}, ValueError, "optimizer_placement"),
])
def test_a_bad_value_is_refused_naming_its_field(options, error, field):
    with pytest.raises(error, match=re.escape(field)):
        TilingOptions(**options)


def test_it_is_frozen_and_keyword_only():
    options = TilingOptions(mlp_types=[nn.Identity])
    assert options.mlp_types == (nn.Identity,)  # a list is kept as a tuple: the object hashes
    hash(options)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.norms = True
    with pytest.raises(TypeError):
        TilingOptions("auto")


def test_the_options_seq_len_chooses_are_those_not_given():
    assert TilingOptions().left_to_plan == {"norms", "attention", "offload"}
    given = TilingOptions(norms=False, offload=None, scratch_mib=64)
    assert given.left_to_plan == {"attention"}
    assert given.given() == {"norms": False, "offload": None, "scratch_mib": 64}
    assert TilingOptions().given() == {}


def test_enable_tiling_with_the_object_trains_exactly_as_with_the_keywords():
    same = {"scratch_mib": 0.05, "loss_scratch_mib": 0.05, "norms": True, "attention": True, "offload": "cpu",
            "grad_accum_dtype": torch.float32}
    by_keywords = tiledmlp.enable_tiling(checkpointed_llama(layers=2), **same)
    by_object = tiledmlp.enable_tiling(checkpointed_llama(layers=2), options=TilingOptions(**same))
    assert tiledmlp.tiled_modules(by_object) == tiledmlp.tiled_modules(by_keywords)
    assert tiling_options_of(by_object) == tiling_options_of(by_keywords) == TilingOptions(**same)
    assert_identical(train_exactly(by_object), train_exactly(by_keywords))


def test_the_options_and_the_keywords_together_are_refused():
    model = checkpointed_llama(layers=2)
    for keywords in ({"norms": True}, {"loss": False}, {"strategy": "plain"}):
        with pytest.raises(TypeError, match="not both: put them all in the TilingOptions"):
            tiledmlp.enable_tiling(model, options=TilingOptions(), **keywords)
    with pytest.raises(TypeError, match="options= takes a tiledmlp.TilingOptions"):
        tiledmlp.enable_tiling(model, options={"norms": True})
    with pytest.raises(TypeError, match="enable_tiling got unknown options"):
        tiledmlp.enable_tiling(model, shards=2)
    assert tiledmlp.tiled_modules(model) == {}


def test_a_tiled_model_s_options_are_read_through_one_accessor():
    model = checkpointed_llama(layers=2)
    assert tiling_options_of(model) is None
    tiledmlp.enable_tiling(model, seq_len=1024, gpu_mib=1 << 20, host_mib=1 << 20)
    chosen = tiling_options_of(model)
    assert chosen.seq_len == 1024 and chosen.left_to_plan == frozenset()  # what seq_len chose, filled in
    assert chosen.offload == "auto"
    tiledmlp.disable_tiling(model)
    assert tiling_options_of(model) is None


def test_plan_memory_takes_the_object_as_the_keywords_it_was_given():
    model = checkpointed_llama(layers=2)
    by_keywords = plan_memory(model, 4096, norms=True, offload="auto", gpu_mib=4096, host_mib=4096)
    by_object = plan_memory(model, 4096, options=TilingOptions(norms=True, offload="auto", gpu_mib=4096,
                                                               host_mib=4096))
    assert by_object == by_keywords
    with pytest.raises(TypeError, match="not both"):
        plan_memory(model, 4096, options=TilingOptions(), norms=True)


def test_a_copy_of_a_model_tiled_with_an_optimizer_object_does_not_carry_the_optimizer():
    """``enable_tiling(model, optimizer=AdamW(...))`` counts the optimizer; the model keeps its bytes, not the object:
    a deep copy of the model would have copied the optimizer and its states with it (and a pickle written them)."""
    model = checkpointed_llama(layers=2)
    optimizer = torch.optim.AdamW(model.parameters())
    tiledmlp.enable_tiling(model, optimizer=optimizer)
    ids = torch.randint(0, 100, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    copied = copy.deepcopy(model)
    for tiled in (model, copied):
        assert tiling_options_of(tiled).optimizer is None and len(pickle.dumps(tiling_options_of(tiled))) < 10_000
    assert plan_memory(model, 4096).optimizer.spec is not None  # still counted, from the bytes kept
