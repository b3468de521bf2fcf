"""The core every tiled call runs through, whatever it tiles: the tiled autograd function (``function``: one autograd
node, shards inside, each parameter's gradient handed to autograd once; ``SHARD_DEPTH``, whether this thread is inside a
shard, which the patched forwards read) and its contract with the forms (``form``), how per-shard parameter gradients
are summed (``accumulate``), how tokens are cut into shards (``sharding``), the same call as one ``torch.compile``
operator (``compiled``; ``OperatorImpl``, what its implementation must provide, which ``tiledmlp.patching``'s
forwards do), a checkpointed call's forward and recompute told apart (``regions``), the names of where memory lives
(``places``: a checkpointed layer input's place, an optimizer's placement), warnings said once (``logs``), and
what differs between the transformers and bitsandbytes releases supported (``compat``: one function per
difference).

Imports ``tiledmlp.kernels`` only: the core knows no form, wrapper or model.
"""
