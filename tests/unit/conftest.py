"""Single-process tests, one folder per subpackage of ``tiledmlp`` (``tests/unit/<subpackage>/``), and here the
tests of whole models, integrations, GPUs, docs and benchmarks. This file puts ``tests/unit`` on ``sys.path``
(pytest does for a rootless conftest's folder), so every test imports the shared helpers ``unit_helpers`` and
``mlp_styles`` by name; and the fixtures several folders share."""

import pytest


@pytest.fixture
def fresh_offloaders(monkeypatch):
    """A fresh host offloader per test that moves every floating argument, however small (the test models' layer
    inputs are a few KB): ``pytestmark = pytest.mark.usefixtures("fresh_offloaders")`` in the offload tests."""
    from tiledmlp.offload import checkpointing, host

    monkeypatch.setattr(checkpointing, "_OFFLOADERS", {})
    monkeypatch.setattr(host, "MIN_BYTES", 0)

