"""Trainers and launchers people use, each through its own extension point, never a fork of its code:
``callback`` (a ``transformers.TrainerCallback`` that tiles the model the trainer trains: ``Trainer``, TRL's
``SFTTrainer``, ``model_init``); ``check`` (``tiledmlp-doctor``: versions, devices, what ``enable_tiling`` would do
to a model's config, known conflicts in a model).

At the top, beside ``patching``; imports what ``enable_tiling``, ``describe`` and ``plan_memory`` are
(``tiledmlp.patching``, ``tiledmlp.plan``), ``tiledmlp.offload`` (the host memory a process may take), and the host
framework when its integration is used (transformers here: an extra, never imported by ``tiledmlp``).
"""

from .callback import TilingCallback

__all__ = ["TilingCallback"]
