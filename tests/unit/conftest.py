"""Single-process tests, one folder per subpackage of ``tiledmlp`` (``tests/unit/<subpackage>/``), and here the
tests of whole models, integrations, GPUs, docs and benchmarks. This file puts ``tests/unit`` on ``sys.path``
(pytest does for a rootless conftest's folder), so every test imports the shared helpers ``unit_helpers`` and
``mlp_styles`` by name."""
