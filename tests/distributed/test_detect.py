"""Wrapper detection and strategy choice, in-process on a gloo world of one process.

``tiled_modules()`` for every wrapping (tiling before and after wrapping), the ``ValueError`` of a
forced strategy that does not fit (naming the one that does), and the refusals that keep a tiled
MLP from running an FSDP2 unit's hooks per shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel as DDP

import tiledmlp

from .models import HIDDEN, GLUMLP as MLP

pytestmark = pytest.mark.distributed

class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(Layer(), Layer())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@pytest.fixture(scope="module", autouse=True)
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    store = dist.FileStore(str(Path(tmp_path_factory.mktemp("pg")) / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def ddp(model: nn.Module) -> nn.Module:
    return DDP(model)


def fsdp2_layers(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp2_mlps(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers:
        fully_shard(layer.mlp, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp2_root(model: nn.Module) -> nn.Module:
    return fully_shard(model, mesh=init_device_mesh("cpu", (1,)))


def fsdp1(unit: type | None, use_orig_params: bool) -> Callable[[nn.Module], nn.Module]:
    policy = ModuleWrapPolicy({unit}) if unit is not None else None
    return lambda model: FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=policy,
                              use_orig_params=use_orig_params)


WRAPPINGS: dict[str, tuple[Callable[[nn.Module], nn.Module], str]] = {
    "none": (lambda m: m, "plain"),
    "ddp": (ddp, "ddp"),
    "fsdp2_layers": (fsdp2_layers, "fsdp2"),
    "fsdp2_mlps": (fsdp2_mlps, "fsdp2"),
    "fsdp2_root": (fsdp2_root, "fsdp2"),
    "fsdp1_flat_root": (fsdp1(None, False), "fsdp1"),
    "fsdp1_flat_layers": (fsdp1(Layer, False), "fsdp1"),
    "fsdp1_flat_mlps": (fsdp1(MLP, False), "fsdp1"),
    "fsdp1_orig_layers": (fsdp1(Layer, True), "fsdp1"),
}


def _train_step(model: nn.Module) -> None:
    model(torch.randn(2, 11, HIDDEN)).square().mean().backward()


@pytest.mark.parametrize("wrapping", list(WRAPPINGS))
def test_tile_after_wrap_reports_the_wrapper(wrapping: str) -> None:
    wrap, expected = WRAPPINGS[wrapping]
    model = wrap(Model())
    tiledmlp.enable_tiling(model, num_shards=3)
    found = tiledmlp.tiled_modules(model)
    assert len(found) == 2 and set(found.values()) == {expected}, found
    # The module tiled is always an MLP itself, never an FSDP1 wrapper that forwards its attributes.
    modules = dict(model.named_modules())
    assert all(isinstance(modules[name], MLP) for name in found), found
    _train_step(model)


@pytest.mark.parametrize("wrapping", [w for w in WRAPPINGS if w != "none"])
def test_tile_before_wrap_resolves_at_run_time(wrapping: str) -> None:
    wrap, expected = WRAPPINGS[wrapping]
    model = Model()
    tiledmlp.enable_tiling(model, num_shards=3)
    assert set(tiledmlp.tiled_modules(model).values()) == {"plain"}
    wrapped = wrap(model)
    _train_step(wrapped)
    assert set(tiledmlp.tiled_modules(wrapped).values()) == {expected}


@pytest.mark.parametrize("wrapping", list(WRAPPINGS))
@pytest.mark.parametrize("forced", ["plain", "ddp", "fsdp2", "fsdp1"])
def test_forced_strategy_must_fit(wrapping: str, forced: str) -> None:
    wrap, fits = WRAPPINGS[wrapping]
    model = wrap(Model())
    if forced == fits:
        tiledmlp.enable_tiling(model, strategy=forced)
        assert set(tiledmlp.tiled_modules(model).values()) == {forced}
        return
    with pytest.raises(ValueError, match=f"strategy='{forced}' does not match .* use strategy='{fits}'"):
        tiledmlp.enable_tiling(model, strategy=forced)
    assert tiledmlp.tiled_modules(model) == {}, "a refused enable_tiling must change nothing"


@pytest.mark.parametrize("wrapping", [w for w in WRAPPINGS if w != "none"])
def test_no_sync_resolves_on_every_syncing_wrapper(wrapping: str) -> None:
    wrap, _ = WRAPPINGS[wrapping]
    model = wrap(Model())
    tiledmlp.enable_tiling(model, strategy="no_sync", num_shards=3)
    assert set(tiledmlp.tiled_modules(model).values()) == {"no_sync"}
    _train_step(model)


def test_no_sync_needs_a_syncing_wrapper() -> None:
    with pytest.raises(ValueError, match="strategy='no_sync' needs a wrapper"):
        tiledmlp.enable_tiling(Model(), strategy="no_sync")


def test_fully_shard_inside_the_mlp_is_refused() -> None:
    model = Model()
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.layers:
        fully_shard(layer.mlp.down_proj, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with pytest.raises(ValueError, match="fully_shard was applied to .* inside this MLP"):
        tiledmlp.enable_tiling(model)


def test_apply_tiled_mlp_refuses_to_call_an_fsdp2_unit_per_shard() -> None:
    """A module-calling ``fn`` on a fully_shard-ed MLP would run its hooks (all-gather, gradient
    reduction) once per shard; it is refused with the fix named."""
    model = fsdp2_mlps(Model())
    mlp = model.layers[0].mlp
    x = torch.randn(2, 11, HIDDEN)
    with pytest.raises(ValueError, match=r"called the FSDP2 unit .* type\(m\)\.forward"):
        tiledmlp.apply_tiled_mlp(lambda m, xs: m(xs), mlp, x, num_shards=3)
    out = tiledmlp.apply_tiled_mlp(lambda m, xs: type(m).forward(m, xs), mlp, x, num_shards=3)
    assert out.shape == x.shape


class ApplyLayer(Layer):
    """Calls its MLP through ``apply_tiled_mlp`` from inside the (FSDP1-wrapped) model's forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + tiledmlp.apply_tiled_mlp(lambda m, xs: type(m).forward(m, xs), self.mlp, self.norm(x), num_shards=3)


def test_apply_tiled_mlp_refuses_fsdp1_flat_parameter_views() -> None:
    """Inside FSDP1's forward with flat parameters, the MLP's weights are plain-tensor views, not
    parameters of the module: they could not get gradients, so the call is refused (fix named)."""
    model = Model()
    model.layers = nn.Sequential(ApplyLayer(), ApplyLayer())
    x = torch.randn(2, 11, HIDDEN)
    with pytest.raises(ValueError, match="use_orig_params=True, or tiledmlp.enable_tiling"):
        fsdp1(None, use_orig_params=False)(model)(x)

