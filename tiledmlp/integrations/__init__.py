"""Trainers and launchers people use, each through its own extension point, never a fork of its code:
``callback`` (a ``transformers.TrainerCallback`` that tiles the model the trainer trains: ``Trainer``, TRL's
``SFTTrainer``, ``model_init``); ``check`` (``tiledmlp-doctor``: versions, devices, what ``enable_tiling`` would do
to a model's config, known conflicts in a model); ``axolotl`` (``TiledMLPPlugin``, an Axolotl plugin handing its
trainer the callback) and ``axolotl_options`` (its ``tiledmlp:`` config section read into ``enable_tiling``'s
options, and the settings refused beside it; without Axolotl).

At the top, beside ``patching``; imports what ``enable_tiling``, ``describe`` and ``plan_memory`` are
(``tiledmlp.patching``, ``tiledmlp.plan``), ``tiledmlp.offload`` (the host memory a process may take),
``tiledmlp.core.compat`` (transformers' checkpointing method of the installed release), and the host
framework when its integration is used (transformers here: an extra, never imported by ``tiledmlp``; Axolotl and its
pydantic in ``axolotl`` only, which this package does not import: Axolotl imports it when a config lists the plugin).
"""

from .callback import TilingCallback

__all__ = ["TilingCallback"]
