"""Tensor parallelism: read a ``parallelize_module`` plan off an MLP, and run its tiles on local shards.

[Note: where the collectives happen, and why tiles never communicate]
A tensor-parallel MLP (``ColwiseParallel`` gate/up, ``RowwiseParallel`` down) is, on each rank, an
ordinary MLP over local weight shards whose output is a partial sum. Untiled, DTensor issues the
collectives at two boundaries only: where the input is made replicated (nothing, or an all-gather
with sequence parallelism) and where the down projection's partial output is reduced (an all-reduce,
or a reduce-scatter to ``Shard(1)``); backward has the mirror images. :class:`TPStrategy` keeps those
boundaries and nothing else:

1. the input is brought to ``Replicate`` exactly as ``ColwiseParallel``'s input hook would (from the
   plan's ``input_layouts``), then made local with ``grad_placements=[Partial()]``: its gradient,
   summed over gate and up *inside* the tiled node, leaves it as one partial sum;
2. the tiled node runs every shard on the local tensors (``DTensor.to_local()`` of each parameter —
   each weight gradient reaches its DTensor parameter once, with the parameter's own placement);
3. its output is wrapped as a ``Partial`` DTensor, the down projection's bias (a ``Replicate``
   DTensor) is added there as DTensor's linear does, and the sum is redistributed to the plan's
   ``output_layouts`` — the one all-reduce or reduce-scatter of the call.

So forward issues the untiled module's collectives, and backward as many or fewer: untiled, split
gate and up projections each all-reduce their input gradient (two all-reduces without sequence
parallelism); tiled, they are summed first (one). No shard ever communicates, so the shard count is
free to differ from rank to rank of the data-parallel dimension.

[Note: reading the plan]
``parallelize_module`` records nothing but forward hooks (``distribute_module``): a lambda over a
``functools.partial`` of the style's static ``_prepare_input_fn``/``_prepare_output_fn`` with its
layouts, and the mesh. :func:`read_style` recognizes exactly those partials (by function identity
against this torch's ``ColwiseParallel``/``RowwiseParallel``), so a torch that records plans some
other way makes tiling refuse a tensor-parallel MLP instead of guessing its layouts.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from ..forms.mlp import MLPLayout, Proj
from .detect import is_dtensor

__all__ = ["TPStyle", "TPPlan", "read_style", "tp_plan", "has_tp_hooks", "tp_hook_count"]


@dataclass(frozen=True)
class TPStyle:
    """One child's ``ColwiseParallel``/``RowwiseParallel`` as its hooks apply it."""

    kind: str  # "colwise" or "rowwise"
    mesh: Any  # DeviceMesh
    input_layout: Any  # Placement
    output_layout: Any  # Placement
    local_output: bool

    def __str__(self) -> str:
        return (f"{self.kind.capitalize()}Parallel(input_layouts={self.input_layout}, "
                f"output_layouts={self.output_layout}) on {self.mesh}")


@dataclass(frozen=True)
class TPPlan:
    """How a tensor-parallel MLP's boundaries are laid out: a local input is ``input_layout`` (the
    gate/up ``input_layouts``), the output is redistributed to ``output_layout`` (the down projection's
    ``output_layouts``) and returned local when ``local_output``."""

    mesh: Any
    input_layout: Any
    output_layout: Any
    local_output: bool


@functools.cache
def _style_functions() -> dict[Any, tuple[str, str]]:
    """The static hook functions of this torch's column- and row-wise styles: function -> (kind, hook)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {ColwiseParallel._prepare_input_fn: ("colwise", "input"),
            ColwiseParallel._prepare_output_fn: ("colwise", "output"),
            RowwiseParallel._prepare_input_fn: ("rowwise", "input"),
            RowwiseParallel._prepare_output_fn: ("rowwise", "output")}


def _hook_style(hook: Callable) -> Optional[tuple[str, str, tuple, Any]]:
    """``(kind, "input" | "output", layout args, mesh)`` of a ``distribute_module`` hook, else None."""
    cells = [c.cell_contents for c in getattr(hook, "__closure__", None) or ()]
    fn = next((c for c in cells if isinstance(c, functools.partial) and c.func in _style_functions()), None)
    if fn is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    mesh = next((c for c in cells if isinstance(c, DeviceMesh)), None)
    kind, where = _style_functions()[fn.func]
    return kind, where, fn.args, mesh


def _style_hooks(module: nn.Module) -> list[tuple[dict, int, tuple[str, str, tuple, Any]]]:
    """``(hook table, handle id, style)`` of every column/row-wise hook on ``module``."""
    return [(table, key, style) for table in (module._forward_pre_hooks, module._forward_hooks)
            for key, hook in table.items() if (style := _hook_style(hook)) is not None]


def has_tp_hooks(module: nn.Module) -> bool:
    return bool(_style_hooks(module))


def tp_hook_count(module: nn.Module) -> int:
    """How many of ``module``'s forward hooks are ``parallelize_module``'s (cheap: none when no hooks)."""
    return len(_style_hooks(module)) if module._forward_hooks or module._forward_pre_hooks else 0


def read_style(module: nn.Module) -> Optional[TPStyle]:
    """The column- or row-wise style ``parallelize_module`` applied to ``module``, or None."""
    found = {where: (kind, args, mesh) for _, _, (kind, where, args, mesh) in _style_hooks(module)}
    if set(found) != {"input", "output"} or found["input"][0] != found["output"][0]:
        return None
    kind, (input_layouts, _desired), mesh = found["input"]
    _, (output_layouts, local_output), _ = found["output"]
    return TPStyle(kind, mesh, input_layouts[0], output_layouts[0], bool(local_output))


def _is_shard_last(p: Any) -> bool:
    return p.is_shard() and p.dim == -1


_PLAN_HINT = ("parallelize_module(mlp, tp_mesh, {gate: ColwiseParallel(), up: ColwiseParallel(), down: "
              "RowwiseParallel()}) (torchtitan's plan; for sequence parallelism with PrepareModuleInput(Shard(1) -> "
              "Replicate()) on the MLP and RowwiseParallel(output_layouts=Shard(1)))")


def refuse_tp_head(name: str) -> None:
    raise ValueError(
        f"loss=True: {name} is tensor parallel (a vocab-sharded head, loss_parallel style); the tiled loss does "
        "not shard the vocabulary yet. Enable tiling with loss=False (the MLPs are still tiled) and compute the "
        "loss under torch.distributed.tensor.parallel.loss_parallel().")


def tp_plan(name: str, module: nn.Module, layout: Optional[MLPLayout], slots: Sequence[Any],
            params: Sequence[torch.Tensor], fsdp2_owned: bool, reason: str = "", head: bool = False) -> Optional[TPPlan]:
    """The tensor-parallel plan of the tiled MLP ``module``, None if it is not tensor parallel.

    ``layout`` is its fast form over ``slots`` (None: generic, because ``reason``); ``params`` the
    tensors in the slots; ``fsdp2_owned``: a ``fully_shard`` unit owns them (their DTensors are then
    FSDP2's, not a plan's); ``head``: ``module`` is a tiled LM head. Raises ValueError, naming the fix,
    for a plan tiling cannot keep exact.
    """
    children = {id(s.owner): s.owner for s in slots}
    styles = {key: read_style(m) for key, m in children.items()}
    if head and (any(styles.values()) or (any(is_dtensor(p) for p in params) and not fsdp2_owned)):
        refuse_tp_head(name)
    if not any(styles.values()):
        if any(is_dtensor(p) for p in params) and not fsdp2_owned:
            raise ValueError(
                f"{name}: its parameters are DTensors but no parallelize_module plan is on its projections "
                "(and no fully_shard unit owns them), so tiling cannot tell how its input and output are "
                f"laid out. Shard it with {_PLAN_HINT}.")
        return None
    if layout is None:
        raise ValueError(
            f"{name}: it is tensor parallel, and a tensor-parallel MLP is tiled only with its fast form "
            f"(the generic form would run its sharded projections, and their collectives, once per "
            f"shard); it gets the generic form because {reason or 'it was not identified'}. Use "
            "form='auto' on a plain GLU or MLP (no dropout, no parameters outside its projections), or "
            "leave this model untiled.")
    names = {id(m): n for n, m in module.named_modules()}

    def style_of(proj: Proj) -> Optional[TPStyle]:
        return styles[id(slots[proj.weight].owner)]

    def child(proj: Proj) -> str:
        return names.get(id(slots[proj.weight].owner), "?")

    ins = [p for p in (layout.gate, layout.up) if p is not None]
    if any(p.adapter is not None for p in (*ins, layout.down)):
        raise ValueError(f"{name}: it is tensor parallel and carries LoRA adapters, which tiling does not shard; "
                         "leave this model untiled, or apply the tensor-parallel plan without peft adapters.")
    up_styles, down = [style_of(p) for p in ins], style_of(layout.down)
    if down is None or down.kind != "rowwise" or any(s is None or s.kind != "colwise" for s in up_styles):
        got = ", ".join(f"{child(p)}: {'no' if style_of(p) is None else style_of(p).kind.capitalize()}Parallel"
                        for p in (*ins, layout.down))
        raise ValueError(f"{name}: its tensor-parallel plan is not column-wise in, row-wise out ({got}); the "
                         f"gate and up projections must be ColwiseParallel and the down projection "
                         f"({child(layout.down)}) RowwiseParallel. Use {_PLAN_HINT}.")
    if len({(s.mesh, s.input_layout) for s in up_styles}) > 1 or any(s.mesh != down.mesh for s in up_styles):
        got = "; ".join(f"{child(p)}: {s}" for p, s in zip(ins, up_styles))
        raise ValueError(f"{name}: its gate and up projections are sharded differently ({got}); give both the "
                         f"same ColwiseParallel() on the mesh of the down projection ({child(layout.down)}).")
    if any(not _is_shard_last(s.output_layout) for s in up_styles) or not _is_shard_last(down.input_layout):
        raise ValueError(f"{name}: its intermediate activations are not left sharded on the last dim "
                         "(ColwiseParallel output_layouts / RowwiseParallel input_layouts other than "
                         f"Shard(-1)); use the defaults: {_PLAN_HINT}.")
    if down.mesh is None or down.mesh.ndim != 1:
        raise ValueError(f"{name}: its tensor-parallel mesh must be 1-D (the 'tp' dimension of the world mesh); "
                         "pass world_mesh['tp'] to parallelize_module.")
    return TPPlan(down.mesh, up_styles[0].input_layout, down.output_layout, down.local_output)


@dataclass
class Localized:
    """A tiled call's tensors on this rank: what the tiled function computes with (``index``: per parameter slot, its
    tensor among ``params``), how its output goes back (``finish``) and the strategy's context for its recompute
    (``around_backward``, ``Strategy.backward_context``).

    ``finish`` is None where the output is already the call's (every strategy but tensor parallel's): the caller
    then returns it as it is, and a call without TP takes no step back into ``distributed/`` after its shards."""

    x: torch.Tensor
    params: list[torch.Tensor]
    layout: Optional[MLPLayout]
    finish: Optional[Callable[[torch.Tensor], Any]] = None
    index: tuple[int, ...] = ()
    around_backward: Callable[[], ContextManager] = contextlib.nullcontext


def localize(plan: TPPlan, name: str, x: torch.Tensor, params: Sequence[torch.Tensor],
             layout: MLPLayout) -> Localized:
    """Local input, local parameter shards and a layout without the down bias, for one call ([Note: where the
    collectives happen, and why tiles never communicate])."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    for p in params:
        if is_dtensor(p) and p.device_mesh != plan.mesh:
            raise ValueError(f"{name}: a parameter is a DTensor on {p.device_mesh}, not on the tensor-parallel "
                             f"mesh {plan.mesh}; with fully_shard over tensor parallelism, tile inside the "
                             "FSDP2 unit's forward (enable_tiling does) so the parameters are unsharded.")
    replicate = (Replicate(),)
    if not isinstance(x, DTensor):  # what ColwiseParallel's input hook makes of a local input
        x = DTensor.from_local(x, plan.mesh, (plan.input_layout,), run_check=False)
    if x.placements != replicate:
        x = x.redistribute(placements=replicate, async_op=True)
    local_x = x.to_local(grad_placements=(Partial(),))
    local = [p.to_local() if is_dtensor(p) else p for p in params]
    bias = None if layout.down.bias is None else params[layout.down.bias]
    if bias is not None:  # not the tiled node's: its gradient comes through the DTensor sum below
        local[layout.down.bias] = local[layout.down.bias].detach()

    def finish(y: torch.Tensor) -> Any:
        out = DTensor.from_local(y, plan.mesh, (Partial(),), run_check=False)
        if bias is not None:  # added to the partial sum, as DTensor's linear adds RowwiseParallel's bias
            out = out + bias
        if out.placements != (plan.output_layout,):
            out = out.redistribute(placements=(plan.output_layout,), async_op=True)
        return out.to_local() if plan.local_output else out

    return Localized(local_x, local, replace(layout, down=replace(layout.down, bias=None)), finish)
