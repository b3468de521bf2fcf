"""Checkpointed layer inputs offloaded to host memory (``offload="cpu"``): ``host`` (the mechanics: pinned
buffers, side-stream copies, prefetch, and their design notes), ``chain`` (inputs recomputed from the layer below,
``offload="auto"``), ``storage`` (tensor helpers of both), ``host_memory`` (what host memory this process may
take, control groups included), ``checkpointing`` (the entry points: a drop-in
``checkpoint``, Hugging Face layers' checkpoint function replaced and restored).

Imports ``tiledmlp.core``. (``tiledmlp.offload`` was one module before the subpackages; what it exported still
is, below.)
"""

from .checkpointing import (OFFLOAD_TARGETS, OffloadingCheckpointFunc, checkpoint, checkpointed_layers,
                            install_offload, offload_problems, offloaded_layers, offloader_for, uninstall_offload)
from .host import HostOffload

__all__ = ["HostOffload", "OffloadingCheckpointFunc", "OFFLOAD_TARGETS", "checkpoint", "checkpointed_layers",
           "install_offload", "uninstall_offload", "offloaded_layers", "offload_problems", "offloader_for"]
