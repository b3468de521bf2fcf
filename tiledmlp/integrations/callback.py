"""``TilingCallback``: ``enable_tiling`` where a trainer builds, adapts or wraps the model itself."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from ..patching.describe import describe
from ..patching.enable import enable_tiling, tiled_modules

__all__ = ["TilingCallback"]

log = logging.getLogger("tiledmlp")


class TilingCallback(TrainerCallback):
    """Tile the trainer's model when training begins: ``Trainer(..., callbacks=[TilingCallback(**options)])``.

    For the models a user does not hold before training: ``model_init`` (a new model per run or trial), and TRL's
    ``SFTTrainer(peft_config=...)`` (the trainer adds the adapters; they take the fast LoRA form from the start).
    ``options`` are ``enable_tiling``'s. A model already tiled is left as it is (its own options stand; modules
    changed since are followed, ``tiledmlp.patching.follow``). The trainer's wrapping (DDP, FSDP, DeepSpeed) is
    detected at the first call, as for a model tiled before wrapping. Costs what ``enable_tiling`` costs, once per
    ``train()``.
    """

    def __init__(self, **options: Any) -> None:
        self.options = options

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            return
        if tiled_modules(model):
            log.info("TilingCallback: %s is already tiled; its options stand", type(model).__name__)
            return
        enable_tiling(model, **self.options)
        log.info("TilingCallback: %s", describe(model).summary())
