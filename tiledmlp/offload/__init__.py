"""Checkpointed layer inputs offloaded to host memory (``offload="cpu"``): ``host`` (the mechanics: pinned
buffers, side-stream copies, prefetch, and their notes), ``chain`` (inputs recomputed from the layer below,
``offload="auto"``), ``storage`` (tensor helpers of both), ``host_memory`` (what host memory this process may
take, control groups included), ``checkpointing`` (the entry points: a drop-in
``checkpoint``, Hugging Face layers' checkpoint function replaced and restored).

Imports ``tiledmlp.core``.
"""
