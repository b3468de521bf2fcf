"""The compiled operator's contract (``tiledmlp.core.compiled.OperatorImpl``): the tiling state of the top layer
implements it, with the protocol's signatures, and the operator refuses a module whose state does not."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import tiledmlp
from tiledmlp.core.compiled import STATE_ATTR, OperatorImpl, module_key, tiled_call
from tiledmlp.patching.state import TilingState
from unit_helpers import llama_mlp


def test_the_tiling_state_implements_the_operators_contract():
    assert issubclass(TilingState, OperatorImpl)
    for name in ("op_forward", "op_backward"):
        declared = inspect.signature(getattr(OperatorImpl, name))
        implemented = inspect.signature(getattr(TilingState, name))
        assert list(implemented.parameters) == list(declared.parameters), name
    model = nn.Sequential(llama_mlp())
    tiledmlp.enable_tiling(model)
    assert isinstance(model[0].__dict__[STATE_ATTR], OperatorImpl)


@pytest.mark.parametrize("state", [None, object()])
def test_the_operator_refuses_a_module_without_a_tiling_state(state):
    module = nn.Linear(8, 8)
    if state is not None:
        module.__dict__[STATE_ATTR] = state
    x = torch.randn(3, 8)
    what = "no tiling state" if state is None else "object"
    with pytest.raises(TypeError, match=f"Linear it was traced for holds {what} .* not an OperatorImpl .*enable_tiling"):
        tiled_call(module_key(module), x, [module.weight], [], 0, 0)
