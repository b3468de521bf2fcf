"""What ``enable_tiling`` does to a model, and the calls it installs. In the order of one call:

``enable`` takes the options (a ``TilingOptions``, ``tiledmlp.plan.options``) and runs the rest, each part given its
bundle of them (``bundles``); ``planning`` recognizes each module (``tiledmlp.recognize``) and
plans its ``state`` (form, strategy, the forward it replaces, its ``call_spec``); ``patch`` installs the planned
forwards per instance and undoes them; ``forwards`` holds those forwards (eager: cut the input, run the call spec;
compiled: the core's operator); ``follow`` tiles modules added after ``enable_tiling``. ``functional`` is the same
call without patching (``apply_tiled_mlp``); ``describe`` reports what was tiled.

The top layer: imports the subpackages below it (all but ``kernels``, which the forms and the core call), and none
imports it.
"""
