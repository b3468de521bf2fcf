"""``TiledMLPPlugin``: tiledmlp in Axolotl, through its plugin interface (``plugins:
[tiledmlp.integrations.axolotl.TiledMLPPlugin]`` and a ``tiledmlp:`` section of ``enable_tiling``'s options).
Imports Axolotl (and its pydantic): Axolotl imports this module when a config lists the plugin; ``tiledmlp`` and
``tiledmlp.integrations`` never do. What the section means and what is refused beside it is
``tiledmlp.integrations.axolotl_options``, which runs without Axolotl.

Where it tiles: a ``TilingCallback`` it hands Axolotl's trainer (``add_callbacks_pre_trainer``) calls
``enable_tiling`` when training begins, on the model the trainer trains: Axolotl's adapters applied (LoRA, QLoRA),
the trainer's checkpointing enabled (``offload`` and ``seq_len`` need it, and the ``Trainer`` turns it on only in
``train()``, after every model hook of the plugin interface), its wrapper (DDP, FSDP, DeepSpeed) detected at the
first call. Tiling in ``post_model_load`` would miss the checkpointing of a full fine-tune; anything the trainer
changes later (adapters, projections) is followed at the next call either way.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

try:
    from axolotl.integrations.base import BasePlugin
    from pydantic import BaseModel, Field
except ImportError as missing:
    raise ImportError(f"tiledmlp.integrations.axolotl is tiledmlp's Axolotl plugin and needs Axolotl ({missing}): "
                      "install axolotl, or read a config's tiledmlp: section without it through "
                      "tiledmlp.integrations.axolotl_options") from missing

from ..patching.describe import describe
from .axolotl_options import OPTIONS, check_config, tiling_options
from .callback import TilingCallback

__all__ = ["TiledMLPArgs", "TiledMLPPlugin"]

#: Axolotl prints INFO records only from loggers named ``axolotl.*`` (tiledmlp's own, ``tiledmlp``, at WARNING and
#: above unless ``LOG_LEVEL=INFO``): the plugin's lines are said where its own plugins' are
log = logging.getLogger("axolotl.integrations.tiledmlp")


class TiledMLPArgs(BaseModel):
    """The plugin's part of Axolotl's config schema: the ``tiledmlp:`` section (Axolotl drops the keys its schema
    does not name when it validates a config)."""

    tiledmlp: Optional[dict[str, Any]] = Field(
        default=None,
        json_schema_extra={"description": "enable_tiling's options for tiledmlp's plugin: " + ", ".join(OPTIONS)})


class TiledMLPPlugin(BasePlugin):
    """tiledmlp for Axolotl: ``enable_tiling(model, **options)`` when training begins, ``options`` the ``tiledmlp:``
    section of the config (``tiledmlp.integrations.axolotl_options.tiling_options``). Refuses, before the model
    loads, what must not run beside it (``check_config``: Axolotl's ``tiled_mlp``, Liger's or Cut Cross-Entropy's
    fused loss while tiledmlp tiles the loss, ``offload``/``seq_len`` without non-reentrant checkpointing). Costs
    what ``enable_tiling`` costs, once per ``train()``."""

    def get_input_args(self) -> str:
        return f"{__name__}.TiledMLPArgs"

    def register(self, cfg: Any) -> None:
        check_config(cfg)  # the config as written, before Axolotl validates it

    def pre_model_load(self, cfg: Any) -> None:
        check_config(cfg)  # as validated and normalized (Axolotl fills gradient_checkpointing_kwargs in)

    def add_callbacks_pre_trainer(self, cfg: Any, model: Any) -> list[Any]:
        options = tiling_options(cfg)
        log.info("%s: enable_tiling(%s) when training begins", type(self).__name__,
                 ", ".join(f"{k}={v!r}" for k, v in options.items()))
        return [_ReportingTilingCallback(**options)]


class _ReportingTilingCallback(TilingCallback):
    """``TilingCallback``, saying what it tiled where Axolotl prints it."""

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        super().on_train_begin(args, state, control, model=model, **kwargs)
        if model is not None:
            log.info("TiledMLPPlugin: %s", describe(model).summary())
