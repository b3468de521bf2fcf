"""Data-parallel and sequence-parallel integration: how a model is wrapped, and what each wrapper needs from a
tiled call.

``detect`` reads the wrapping; ``selection`` picks a strategy from it; ``strategies`` holds one small class per wrapper
(the contexts a tiled call runs in); ``deepspeed`` and ``tensor_parallel`` are the mechanics two of them need;
``sequence_parallel`` and ``context_parallel`` see one sequence split across ranks; ``hooks`` tells the wrappers' hooks
inside a tiled module from the user's. Imports ``tiledmlp.forms`` only (the MLP layout tensor parallelism localizes, the
strategies' TP context).
"""
