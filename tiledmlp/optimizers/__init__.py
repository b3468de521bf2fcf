"""Where an optimizer's memory lives and when it steps: ``spec`` (what an optimizer costs per parameter and where:
the rules the memory plan sums, and the names it takes), ``in_backward`` (the step fused into backward: each
parameter stepped and its gradient freed as soon as it is complete), ``build`` (an optimizer by name and placement:
torch's or bitsandbytes' on the device, stepped in backward, or torchao's ``CPUOffloadOptimizer`` on the host).

It places; ``tiledmlp.plan`` decides where (within the same budgets as the checkpointed layers' inputs). No
optimizer of its own: torch's hooks, torchao, and the engines' offload (DeepSpeed, FSDP2) do the work. Imports
nothing else of tiledmlp but the placements' names (``tiledmlp.core.places``).
"""

from .build import build_optimizer
from .in_backward import GradientAccumulationError, StepInBackward, step_in_backward
from .spec import BACKWARD, GPU, HOST, PLACEMENTS, OptimizerSpec, spec_named, spec_of

__all__ = ["build_optimizer", "step_in_backward", "StepInBackward", "GradientAccumulationError", "OptimizerSpec",
           "spec_of", "spec_named", "PLACEMENTS", "GPU", "BACKWARD", "HOST"]
