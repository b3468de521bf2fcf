"""The LM head + cross-entropy, tiled: ``cross_entropy`` (the loss of ``hidden @ weight.T`` without the
``tokens x vocab`` logits, a client of the core's tiled function), ``heads`` (Hugging Face causal LMs' heads and
loss functions patched per instance), ``lazy_logits`` (the logits placeholder a patched head returns).

Imports ``tiledmlp.distributed`` (strategies, a sequence split), ``tiledmlp.forms``, ``tiledmlp.core`` and
``tiledmlp.kernels``.
"""
