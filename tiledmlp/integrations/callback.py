"""``TilingCallback``: ``enable_tiling`` where a trainer builds, adapts or wraps the model itself, with the optimizer
the trainer built in its memory plan."""

from __future__ import annotations

import logging
from typing import Any, Optional

from transformers import TrainerCallback

from ..optimizers.spec import BACKWARD
from ..patching.describe import describe
from ..patching.enable import enable_tiling, tiled_modules
from ..plan.optimizer import placements_for
from ..plan.options import LENGTH_OPTIONS, TilingOptions
from ..plan.plans import plan_memory

__all__ = ["TilingCallback"]

log = logging.getLogger("tiledmlp")


def _why_not_in_backward(args: Any) -> Optional[str]:
    """What in the trainer's arguments needs every gradient before the optimizer steps (None: nothing)."""
    reasons = []
    if (getattr(args, "max_grad_norm", 0) or 0) > 0:
        reasons.append(f"clips gradients by their global norm (max_grad_norm={args.max_grad_norm}; 0 turns it off)")
    if (getattr(args, "gradient_accumulation_steps", 1) or 1) > 1:
        reasons.append(f"accumulates {args.gradient_accumulation_steps} micro-batches per step "
                       "(gradient_accumulation_steps=1, with a longer sequence or a larger batch instead)")
    return " and ".join(reasons) or None


class TilingCallback(TrainerCallback):
    """Tile the trainer's model when training begins: ``Trainer(..., callbacks=[TilingCallback(**options)])``.

    For the models a user does not hold before training: ``model_init`` (a new model per run or trial), and TRL's
    ``SFTTrainer(peft_config=...)`` (the trainer adds the adapters; they take the fast LoRA form from the start).
    ``options`` are ``enable_tiling``'s. With ``seq_len``, the plan counts the optimizer the trainer built (its
    ``optim``: ``adamw_torch_fused``, ``adamw_torch``, ``adamw_bnb_8bit``, ``paged_adamw_8bit``, ...) and, where the
    step fits only with that optimizer stepped in backward, makes it so (``tiledmlp.step_in_backward``), said in the
    log; a trainer that clips gradients by their global norm or accumulates micro-batches cannot step in backward, and
    such a length is refused naming the argument to change. A model already tiled is left as it is (its own options
    stand; modules changed since are followed, ``tiledmlp.patching.follow``). The trainer's wrapping (DDP, FSDP,
    DeepSpeed) is detected at the first call, as for a model tiled before wrapping. Costs what ``enable_tiling``
    costs, once per ``train()``.
    """

    def __init__(self, **options: Any) -> None:
        self.options = options

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        if model is None:
            return
        if tiled_modules(model):
            log.info("TilingCallback: %s is already tiled; its options stand", type(model).__name__)
            return
        options = dict(self.options)
        blocked = None
        if "seq_len" in options and optimizer is not None and "optimizer" not in options:
            options["optimizer"] = optimizer
            blocked = _why_not_in_backward(args)
            if blocked is not None:  # the trainer's own placement only
                device = next(model.parameters()).device
                options["optimizer_placement"] = placements_for(optimizer, device)[0]
        tiling = TilingOptions.from_kwargs(options)
        try:
            enable_tiling(model, options=tiling)
        except ValueError as error:
            if blocked is None or not self._fits_in_backward(model, tiling):
                raise
            raise ValueError(f"{error}. Stepping the trainer's optimizer in backward would make it fit, but this "
                             f"trainer {blocked}") from error
        log.info("TilingCallback: %s", describe(model).summary())

    @staticmethod
    def _fits_in_backward(model: Any, options: TilingOptions) -> bool:
        """Whether ``options``' length would fit with the optimizer stepped in backward, and the memory options not
        given on."""
        given = {k: v for k, v in options.given().items() if k in LENGTH_OPTIONS}
        try:
            what_if = TilingOptions(**{"offload": "auto", "norms": True, "attention": True, **given,
                                       "optimizer_placement": BACKWARD}, gpu_mib=options.gpu_mib,
                                    host_mib=options.host_mib)
            return plan_memory(model, options.seq_len, options=what_if).fits
        except ValueError:
            return False
