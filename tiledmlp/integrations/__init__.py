"""Trainers and launchers people use, each through its own extension point, never a fork of its code:
``callback`` (a ``transformers.TrainerCallback`` that tiles the model the trainer trains: ``Trainer``, TRL's
``SFTTrainer``, ``model_init``).

At the top, beside ``patching``; imports only what ``enable_tiling`` and ``describe`` are (``tiledmlp.patching``),
and the host framework when its integration is used (transformers here: an extra, never imported by ``tiledmlp``).
"""

from .callback import TilingCallback

__all__ = ["TilingCallback"]
