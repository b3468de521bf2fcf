"""The compiled operator's contract (``tiledmlp.core.compiled.OperatorImpl``): the top layer's body for the operators
(``tiledmlp.patching.forwards.CompiledCall``) implements it, with the protocol's signatures, every tiled module's key
carries it, and the operator refuses a module whose tiling state is gone or a key whose object is not one."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import tiledmlp
from tiledmlp.core.compiled import STATE_ATTR, OperatorImpl, module_key, tiled_call
from tiledmlp.patching.forwards import COMPILED_CALL, CompiledCall
from unit_helpers import llama_mlp


def test_the_compiled_call_implements_the_operators_contract():
    assert issubclass(CompiledCall, OperatorImpl)
    for name in ("op_forward", "op_backward"):
        declared = inspect.signature(getattr(OperatorImpl, name))
        implemented = inspect.signature(getattr(CompiledCall, name))
        assert list(implemented.parameters) == list(declared.parameters), name
    model = nn.Sequential(llama_mlp())
    tiledmlp.enable_tiling(model)
    assert model[0].__dict__[STATE_ATTR].key._tiledmlp_impl is COMPILED_CALL


@pytest.mark.parametrize("state", [None, object()])
def test_the_operator_refuses_a_module_without_a_tiling_state(state):
    module = nn.Linear(8, 8)
    if state is not None:
        module.__dict__[STATE_ATTR] = state
    x = torch.randn(3, 8)
    what = "no tiling state" if state is None else "object"
    with pytest.raises(TypeError, match=f"Linear it was traced for holds {what} .* not a TilingState .*enable_tiling"):
        tiled_call(module_key(module, COMPILED_CALL), x, [module.weight], [], 0, 0)


def test_the_operator_refuses_a_key_without_an_implementation():
    module = nn.Linear(8, 8)
    with pytest.raises(TypeError, match="key of the Linear it was traced for carries object, not an OperatorImpl"):
        tiled_call(module_key(module, object()), torch.randn(3, 8), [module.weight], [], 0, 0)
