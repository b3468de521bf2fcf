"""Shard policy: the anchors' automatic rule, fixed counts, fixed tile sizes, and bad values."""

from __future__ import annotations

import math

import pytest

from tiledmlp import ShardPolicy, auto_num_shards
from tiledmlp.core.sharding import DEFAULT_SCRATCH_MIB, chunk_bounds, dh_blocks
from tiledmlp.forms.mlp import MLPScratch


def mlp_scratch_per_token(inter: int, itemsize: int, inter_chunks: int = 1, gated: bool = True) -> int:
    return MLPScratch(inter, itemsize, gated).backward_bytes_per_token(inter_chunks)


@pytest.mark.parametrize("tokens, hidden, shards", [(1, 4096, 1), (4096, 4096, 1), (4097, 4096, 2), (131072, 4096, 32)])
def test_generic_auto_rule_is_ceil_tokens_over_hidden(tokens, hidden, shards):
    assert auto_num_shards(tokens, hidden) == shards
    assert ShardPolicy().shard_rows(tokens, hidden) == math.ceil(tokens / shards)


@pytest.mark.parametrize("tokens, inter, scratch_mib, tile", [
    (131072, 14336, None, (16384, 2)),  # Llama-3-8B, bf16: 16384 tokens in two blocks = 512 MiB of scratch
    (32768, 14336, None, (16384, 2)),  # two shards rather than four of 8192 in one block
    (8192, 14336, None, (8192, 1)),  # one shard either way: one block
    (9000, 14336, None, (9000, 2)),  # one shard in two blocks rather than two in one
    (4000, 14336, None, (4000, 1)),  # short sequences: one shard, one block
    (40000, 14336, None, (13334, 2)),  # three equal shards rather than 16384 + 16384 + 7232
    (131072, 28672, None, (8192, 2)),  # Llama-70B: 8192 tokens in two blocks fit the budget
    (131072, 14336, 200, (5958, 2)),  # a tighter budget: 6144 fit, made 22 equal shards
    (131072, 14336, 16, (1024, 5)),  # below 1024 tokens the intermediate dimension is split further
])
def test_glu_auto_tile_is_the_fastest_within_the_scratch_budget(tokens, inter, scratch_mib, tile):
    rows, chunks = ShardPolicy(scratch_mib=scratch_mib).mlp_tile(tokens, MLPScratch(inter, 2))
    assert (rows, chunks) == tile
    assert rows * mlp_scratch_per_token(inter, 2, chunks) <= (scratch_mib or DEFAULT_SCRATCH_MIB) * 2**20


def test_glu_auto_tile_with_fixed_blocks_takes_the_longest_fitting_shard():
    assert ShardPolicy(inter_chunks=1).mlp_tile(131072, MLPScratch(14336, 2)) == (8192, 1)
    assert ShardPolicy(inter_chunks=4).mlp_tile(131072, MLPScratch(14336, 2)) == (16384, 4)  # capped at MAX_AUTO_TILE


def test_glu_forward_shards_are_equal_parts_of_a_backward_shard_within_the_budget():
    """The forward keeps gate and up of its whole shard (``2 * inter`` elements per token)."""
    policy = ShardPolicy()
    assert policy.mlp_forward_rows(MLPScratch(14336, 2), 16384) == 8192  # 9362 tokens fit 512 MiB
    assert policy.mlp_forward_rows(MLPScratch(14336, 2), 8192) == 8192
    assert policy.mlp_forward_rows(MLPScratch(14336, 2), 13334) == 6667
    assert ShardPolicy(scratch_mib=64).mlp_forward_rows(MLPScratch(14336, 2), 4000) == 1000


def test_glu_scratch_counts_gate_up_and_one_dh_block():
    assert dh_blocks(14336) == [(0, 4096), (4096, 8192), (8192, 12288), (12288, 14336)]
    assert dh_blocks(1500) == [(0, 1500)]  # narrower blocks would lose more GEMM speed than they save
    assert mlp_scratch_per_token(14336, 2) == (2 * 14336 + 4096) * 2
    assert mlp_scratch_per_token(14336, 2, inter_chunks=2) == (2 * 7168 + 2048) * 2


def test_blocks_are_aligned_for_fast_gemms():
    """Every block but the last is a multiple of 64 wide (a 16-byte-misaligned bf16 column block
    sends cuBLAS to kernels ~4x slower), dh blocks a multiple of 1024, so a block count may come out
    lower than asked."""
    assert chunk_bounds(14336, 3) == [(0, 4800), (4800, 9600), (9600, 14336)]
    assert dh_blocks(7168) == [(0, 2048), (2048, 4096), (4096, 6144), (6144, 7168)]
    assert dh_blocks(11008) == [(0, 3072), (3072, 6144), (6144, 9216), (9216, 11008)]
    assert dh_blocks(3000) == [(0, 2048), (2048, 3000)]
    assert dh_blocks(6400, gated=False) == [(0, 6400)]  # a plain MLP computes dh whole...
    assert dh_blocks(10240, gated=False) == dh_blocks(10240)  # ...while 16384 tokens of it fit 512 MiB
    assert mlp_scratch_per_token(10240, 2, gated=False) == (10240 + 3072) * 2
    assert mlp_scratch_per_token(6400, 2, gated=False) == 2 * 6400 * 2  # no gate rows, a whole dh
    assert chunk_bounds(88, 3) == [(0, 64), (64, 88)]
    assert chunk_bounds(5, 8) == [(0, 5)]


def test_glu_fixed_tiles_override_the_budget():
    assert ShardPolicy(tile_tokens=2048, inter_chunks=3).mlp_tile(10000, MLPScratch(14336, 2)) == (2048, 3)
    assert ShardPolicy(num_shards=4).mlp_tile(10000, MLPScratch(14336, 2)) == (2500, 1)


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
    ({"inter_chunks": 0}, ValueError, "inter_chunks must be >= 1"),
    ({"scratch_mib": 0}, ValueError, "scratch_mib must be a positive number of MiB"),
    ({"scratch_mib": -1.5}, ValueError, "scratch_mib must be a positive number of MiB"),
    ({"scratch_mib": float("inf")}, ValueError, "scratch_mib must be a positive number of MiB"),
    ({"scratch_mib": "1G"}, TypeError, "scratch_mib must be a positive number of MiB"),
])
def test_bad_values_are_refused(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ShardPolicy(**kwargs)


@pytest.mark.parametrize("value, exc", [(0, ValueError), (-0.5, ValueError), ("64M", TypeError), (True, TypeError),
                                        (0.05, None), (64, None)])
def test_both_scratch_budgets_take_the_same_values(value, exc):
    """``scratch_mib`` and ``loss_scratch_mib`` accept and refuse the same things (fractions of a MiB included)."""
    import tiledmlp
    from unit_helpers import build

    for option in ("scratch_mib", "loss_scratch_mib"):
        model = build("llama")
        if exc is None:
            tiledmlp.enable_tiling(model, **{option: value})
        else:
            with pytest.raises(exc, match=f"{option} must be a positive number of MiB"):
                tiledmlp.enable_tiling(model, **{option: value})
