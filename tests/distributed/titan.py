"""A torchtitan-shaped Llama, tiny, written here (not imported): ``FeedForward`` with ``w1``/``w2``/``w3``,
``Attention``, ``TransformerBlock``, ``Transformer``, and torchtitan's tensor-parallel plan (``apply_tp``)
with and without sequence parallelism, plus its 2-D form (``fully_shard`` per block over TP).

Sizes make tiling cut every MLP call into several uneven shards and divide by a TP degree of 2 or 4.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

DIM, HIDDEN_DIM, N_HEADS, VOCAB, N_LAYERS = 32, 88, 4, 64, 2


class FeedForward(nn.Module):
    """torchtitan's: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int = DIM, hidden_dim: int = HIDDEN_DIM) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class BiasedMLP(nn.Module):
    """A GPT-style plain MLP with biases (the down projection's bias is ``RowwiseParallel``'s Replicate)."""

    def __init__(self, dim: int = DIM, hidden_dim: int = HIDDEN_DIM) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def fused_glu() -> nn.Module:
    """Phi-3's MLP: one fused ``gate_up_proj`` (``ColwiseParallel`` shards it as a whole, so each rank's
    ``chunk(2)`` splits its own slice, tiled or not) and ``down_proj``."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    return Phi3MLP(Phi3Config(hidden_size=DIM, intermediate_size=HIDDEN_DIM, hidden_act="silu"))


class Attention(nn.Module):
    """Causal multi-head attention as torchtitan writes it (``view(bs, seqlen, -1, head_dim)``, so the
    local head count follows the TP shard); no rotary embedding, which tiling does not touch."""

    def __init__(self, dim: int = DIM, n_heads: int = N_HEADS) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q, k, v = (w(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class TransformerBlock(nn.Module):
    def __init__(self, mlp: Callable[[], nn.Module] = FeedForward) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """``forward(ids, labels)`` returns the mean next-token cross-entropy."""

    def __init__(self, mlp: Callable[[], nn.Module] = FeedForward) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(mlp) for i in range(N_LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers.values():
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def mlp_plan(mlp: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """The MLP's entries of torchtitan's plan, relative to the MLP (column-wise in, row-wise out)."""
    names = [n for n, c in mlp.named_children() if isinstance(c, nn.Linear)]
    *ins, down = names if names != ["w1", "w2", "w3"] else ["w1", "w3", "w2"]
    plan: dict[str, Any] = {n: ColwiseParallel() for n in ins}
    plan[down] = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    if sequence_parallel:
        plan[""] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def apply_tp(model: Transformer, tp_mesh: Any, sequence_parallel: bool = True) -> Transformer:
    """torchtitan's ``apply_tp`` for this model: vocab-parallel embedding and head, column/row-wise
    attention and MLP, ``SequenceParallel`` norms with ``PrepareModuleInput`` (when ``sequence_parallel``)."""
    sp = sequence_parallel
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()),
        **({"norm": SequenceParallel()} if sp else {}),
        "output": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()),
    })
    for block in model.layers.values():
        plan: dict[str, Any] = {f"attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}
        plan["attention.wo"] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        if sp:
            plan["attention_norm"] = plan["ffn_norm"] = SequenceParallel()
            plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({f"feed_forward.{k}".rstrip("."): v for k, v in mlp_plan(block.feed_forward, sp).items()})
        parallelize_module(block, tp_mesh, plan)
    return model


def apply_fsdp(model: nn.Module, dp_mesh: Any, **options: Any) -> nn.Module:
    """torchtitan's ``apply_fsdp``: every block a unit, then the root, on the data-parallel mesh."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, **options)
    fully_shard(model, mesh=dp_mesh, **options)
    return model


def world_meshes(device_type: str, world: int, tp: int) -> tuple[Optional[Any], Any]:
    """``(dp mesh or None, tp mesh)`` of a ``("dp", "tp")`` world mesh (1-D ``("tp",)`` when ``tp == world``)."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp == world:
        return None, init_device_mesh(device_type, (tp,), mesh_dim_names=("tp",))
    mesh = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]
