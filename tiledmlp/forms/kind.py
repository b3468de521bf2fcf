"""Which form a tiled module takes (:class:`Kind`), spelled once: recognition answers one
(``tiledmlp.recognize.candidates.Recognized``), each tiling state keeps it (``tiledmlp.patching.state.TilingState``),
and ``describe()`` prints its value.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Kind"]


class Kind(str, Enum):
    """A tiled module's form. Also a ``str``: equal to its value (``Kind.GLU == "glu"``, hashed alike), printed as it
    (``str``, ``format``, ``%s``, ``json``), so code and pickles that spelled the value keep working."""

    GLU = "glu"  # fast: down(act(gate(x)) * up(x)), split or fused gate/up (tiledmlp.forms.mlp)
    MLP = "mlp"  # fast: down(act(up(x))) (tiledmlp.forms.mlp)
    MOE = "moe"  # fast: a MoE layer's experts, routed once (tiledmlp.forms.moe)
    GENERIC = "generic"  # the module's own forward, recomputed per shard (tiledmlp.forms.base)
    NORM = "norm"  # a normalization layer, on the generic form (enable_tiling(norms=True))
    PROJ = "proj"  # a LoRA-adapted projection, fast or generic (enable_tiling(projections=True))
    LOSS = "loss"  # the tiled LM head + cross-entropy (tiledmlp.loss)
    EXCLUDED = "excluded"  # recognition only: neither the module nor anything inside it is tiled

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__  # f"{kind}" is the value on every Python (3.11's Enum.__format__ is not)
    __hash__ = str.__hash__  # a Kind and its value are one dict key (Enum.__hash__ hashes the member's name)
