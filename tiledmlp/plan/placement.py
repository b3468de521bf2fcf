"""Where the checkpointed layers' inputs go for a step (``offload``: kept on the device, on the host, or recomputed
from the layer below) and which layers keep their attention output: the placement the plan reports and
``offload="auto"`` executes, found by the step's peaks (:func:`tiledmlp.plan.memory.step_peak`; that module's design
notes say what the peaks hold and why the search below finds the best placement)."""

from __future__ import annotations

from typing import Optional

from ..offload import host
from .memory import GPU, HOST, RECOMPUTE, Peak, Placed, StepOptions, attention_kept_bytes, step_peak
from .shapes import ModelShape

__all__ = ["arrange", "place"]


def arrange(n: int, on_gpu: int, recomputed: int) -> Optional[tuple[str, ...]]:
    """``n`` places: the top ``on_gpu`` layers on the device, ``recomputed`` of the others recomputed, the rest on the
    host; None when that cannot be (layer 0 is never recomputed: nothing below it). The recomputed layers form runs
    above each layer on the host, as even as they can be (a run of ``k`` holds ``k`` inputs at its rebuild and costs
    ``k (k + 1) / 2`` layer forwards: even runs minimize both), the longer runs highest (the gradients fewest)."""
    below = n - on_gpu
    if recomputed > max(below - 1, 0):
        return None
    kept = below - recomputed  # layers on the host, each followed by its run of recomputed layers
    places: list[str] = []
    for j in range(kept):
        run = recomputed // kept + (j >= kept - recomputed % kept)
        places += [HOST] + [RECOMPUTE] * run
    return tuple(places) + (GPU,) * on_gpu


def place(shape: ModelShape, options: StepOptions, tokens: int, gpu_budget: Optional[int],
          host_budget: Optional[int], spend: bool = True) -> tuple[Placed, Peak]:
    """The placement of the inputs of the checkpointed layers for ``options.offload``
    (``"auto"``: ``tiledmlp.plan.memory``, [Note: placement]; ``"cpu"``: every one on the host; None: every one kept),
    which layers keep their attention output (``"auto"`` with ``spend``: what is left of the device budget, spent), and
    its peaks. Under ``"auto"``, when nothing fits the budgets, the placement that needs the least device memory."""
    n = len(shape.layer_grad_bytes)
    none_kept = (False,) * n
    if tokens * shape.layer_input_bytes_per_token < host.MIN_BYTES or not shape.checkpointed:
        places = (GPU,) * n  # too small to move (the offloader keeps it), or nothing checkpointed to move
        return (places, none_kept), step_peak(shape, options, tokens, places)
    if options.offload != "auto":
        places = (HOST if options.offload == "cpu" else GPU,) * n
        return (places, none_kept), step_peak(shape, options, tokens, places)
    kept = max(tokens * shape.layer_input_bytes_per_token, 1)
    # the host budget holds the optimizer's host bytes first (they are there for the whole step), then inputs
    host_slots = n if host_budget is None else max(host_budget - options.optimizer.host_bytes, 0) // kept
    best = None
    for on_gpu in range(n, -1, -1):
        places = arrange(n, on_gpu, max(n - on_gpu - host_slots, 0))
        if places is None:
            continue
        peak = step_peak(shape, options, tokens, places)
        if gpu_budget is None or peak.gpu_bytes <= gpu_budget:
            if not spend:
                return (places, none_kept), peak
            return _spend(shape, options, tokens, gpu_budget, host_slots, on_gpu, places, peak)
        if best is None or peak.gpu_bytes < best[1].gpu_bytes:
            best = ((places, none_kept), peak)
    if best is None:  # not even the host has room with every possible layer recomputed
        places = arrange(n, 0, max(n - 1, 0)) or (HOST,) * n
        best = ((places, none_kept), step_peak(shape, options, tokens, places))
    return best


def _spend(shape: ModelShape, options: StepOptions, tokens: int, gpu_budget: Optional[int], host_slots: int,
           on_gpu: int, places: tuple[str, ...], peak: Peak) -> tuple[Placed, Peak]:
    """The fitting ``places`` (``on_gpu`` inputs on the device) with what the device budget has left spent on kept
    attention outputs first, then inputs on the device ([Note: free memory spent on speed]): the most
    layers keeping their output, with as many inputs on the device as then fit, and no more recomputed layers."""
    n = len(places)
    if not attention_kept_bytes(shape, options, tokens):
        return (places, (False,) * n), peak
    recomputed = places.count(RECOMPUTE)
    best = ((places, (False,) * n), peak, 0)
    for gpu_inputs in range(on_gpu, -1, -1):  # fewer inputs on the device leaves room for more kept outputs
        arranged = arrange(n, gpu_inputs, max(n - gpu_inputs - host_slots, 0))
        if arranged is None or arranged.count(RECOMPUTE) > recomputed:
            break
        low, high, found = best[2] + 1, n, None  # the most top layers keeping theirs that fit (monotone)
        while low <= high:
            middle = (low + high) // 2
            keeps = (False,) * (n - middle) + (True,) * middle
            trial = step_peak(shape, options, tokens, arranged, keeps)
            if gpu_budget is None or trial.gpu_bytes <= gpu_budget:
                found, low = ((arranged, keeps), trial, middle), middle + 1
            else:
                high = middle - 1
        if found is not None:
            best = found
        if best[2] == n:
            break
    return best[0], best[1]
