"""Where memory lives, named once: a checkpointed layer's input between its forward and its backward
(:class:`Place`, which the plan's terms also use for the device and the host) and an optimizer's states and step
(:class:`OptimizerPlacement`). Each name is its string too (``Place.HOST == "host"``, printed ``host``), so the options
that take them (``optimizer_placement="host"``, an offloader's ``places``) keep taking plain strings."""

from __future__ import annotations

from enum import Enum

__all__ = ["Place", "OptimizerPlacement"]


class _Name(str, Enum):
    """A name that compares, hashes, prints and formats as its string (``repr`` included: messages read as before)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)


class Place(_Name):
    """Where a checkpointed layer's input waits for its backward (and, for the plan's terms, where bytes are)."""

    GPU = "gpu"  # kept on the device, as plain checkpointing keeps it
    HOST = "host"  # copied to pinned host memory and back (``tiledmlp.offload.host``)
    RECOMPUTE = "recompute"  # kept nowhere: rebuilt from the layer below (``tiledmlp.offload.chain``)


class OptimizerPlacement(_Name):
    """Where an optimizer's states live and when it steps (``tiledmlp.optimizers.spec``, [Note: what an optimizer holds,
    and when]), fastest first."""

    GPU = "gpu"  # on the device, stepped after backward
    BACKWARD = "backward"  # on the device, each parameter stepped inside backward and its gradient freed
    HOST = "host"  # on the host with a copy of each parameter and gradient, stepped on the CPU
