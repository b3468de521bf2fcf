"""Shard policy: the anchors' automatic rule, fixed counts, fixed tile sizes, and bad values."""

from __future__ import annotations

import math

import pytest

from tiledmlp import ShardPolicy, auto_num_shards


@pytest.mark.parametrize("tokens, hidden, shards", [(1, 4096, 1), (4096, 4096, 1), (4097, 4096, 2), (131072, 4096, 32)])
def test_auto_rule_is_ceil_tokens_over_hidden(tokens, hidden, shards):
    assert auto_num_shards(tokens, hidden) == shards
    assert ShardPolicy().shard_rows(tokens, hidden) == math.ceil(tokens / shards)


def test_fixed_count_and_fixed_tile():
    assert ShardPolicy(num_shards=3).shard_rows(10, 4) == 4  # shards of 4, 4, 2
    assert ShardPolicy(num_shards=8).shard_rows(3, 4) == 1  # fewer tokens than shards
    assert ShardPolicy(tile_tokens=1024).shard_rows(5000, 4) == 1024
    assert ShardPolicy(tile_tokens=1024).shard_rows(100, 4) == 100


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"num_shards": 0}, ValueError, "num_shards must be >= 1"),
    ({"num_shards": -2}, ValueError, "num_shards must be >= 1"),
    ({"num_shards": 2.0}, TypeError, "num_shards must be an int"),
    ({"num_shards": True}, TypeError, "num_shards must be an int"),
    ({"tile_tokens": 0}, ValueError, "tile_tokens must be >= 1"),
    ({"num_shards": 2, "tile_tokens": 8}, ValueError, "not both"),
])
def test_bad_values_are_refused(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ShardPolicy(**kwargs)
