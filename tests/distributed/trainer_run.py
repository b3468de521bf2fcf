"""The Hugging Face ``Trainer`` run the torchrun cases compare tiled and untiled with (``cases_sp``: DeepSpeed's
Ulysses through accelerate; ``cases_cp``: torch's ring): :func:`trainer_run`."""

from __future__ import annotations

import gc
import tempfile
from typing import Any, Callable, Iterable

import torch
from torch import nn

import tiledmlp


def trainer_run(model: nn.Module, data: list[dict[str, torch.Tensor]], parallelism: Any, lr: float,
                params_of: Callable[[Any], dict[str, torch.Tensor]], undo: Iterable[Callable[[], None]] = (),
                **arguments: Any) -> tuple[float, dict[str, torch.Tensor], dict[str, str]]:
    """Two ``Trainer`` steps of ``model`` on ``data`` (one sequence a step and rank) under accelerate's
    ``ParallelismConfig`` ``parallelism``: SGD at ``lr``, no clipping, seed 0, nothing saved or logged;
    ``arguments`` add to ``TrainingArguments`` (the wrapper: ``fsdp``, ``deepspeed``). Returns the training loss,
    ``params_of(trainer)`` (the whole parameters, however the wrapper holds them) and ``tiled_modules`` of the
    wrapped model; ``undo`` (then accelerate's state reset) runs whatever happens."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=1, report_to=[],
                             parallelism_config=parallelism, learning_rate=lr, optim="sgd", max_grad_norm=0.0,
                             save_strategy="no", logging_strategy="no", seed=0, **arguments)
    try:
        trainer = Trainer(model=model, args=args, train_dataset=data)
        loss = trainer.train().training_loss
        strategies = tiledmlp.tiled_modules(trainer.model_wrapped)
        params = params_of(trainer)
    finally:
        for step in undo:
            step()
        AcceleratorState._reset_state(reset_partial_state=False)
        gc.collect()
    return loss, params, strategies
