"""A tiny llama-like model, cut into pipeline stages and parallelized with torch's own APIs.

The model follows torchtitan's layout so its parameter names, placements and
schedules are the ones a real trainer hands to the clip:

* ``tok_embeddings`` → ``layers`` (a ``ModuleDict`` keyed by the global layer
  id, so a stage keeps the fully qualified names it had in the whole model)
  → ``norm`` → ``output``; a layer's feed-forward is dense or a small MoE;
* :func:`build_stage` builds the whole model from a seed (same weights on
  every rank) and keeps the pieces one pipeline stage owns;
* :func:`apply_tp` / :func:`apply_fsdp` / :func:`apply_ep` / :func:`apply_ddp`
  call ``parallelize_module``, ``fully_shard``, expert sharding and
  ``DistributedDataParallel`` as torchtitan does;
* :func:`run_pipeline` runs one forward/backward step with
  ``torch.distributed.pipelining`` (``ScheduleGPipe``, ``Schedule1F1B``, or
  ``ScheduleInterleaved1F1B`` for several stages per rank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

# The dense building blocks are the demo's: they read only dim/n_heads/hidden.
from ppclip_func.demo import Attention, FeedForward, RMSNorm


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    dim: int = 16
    n_heads: int = 2
    hidden: int = 32
    vocab: int = 32
    n_layers: int = 2
    moe_layers: tuple[int, ...] = ()  # layers whose feed-forward is a MoE
    n_experts: int = 4
    seq_len: int = 8
    tie_embeddings: bool = False  # the output head starts as the input embedding's weight


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU-less MLPs stored as 3-D weights (expert dim first), as in torchtitan.

    Under expert parallelism the weights are DTensors sharded on the expert
    dim over an ``ep`` mesh; tokens are all-gathered over that mesh, each rank
    runs its own experts on the tokens routed to them, and a reduce-scatter
    returns every token's output to its rank (an all-gather/reduce-scatter
    token dispatcher).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(args.n_experts, args.dim, args.hidden) * args.dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(args.n_experts, args.hidden, args.dim) * args.hidden**-0.5)
        self.ep_mesh: DeviceMesh | None = None

    def forward(self, tokens: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.w1, self.w2
        if isinstance(w1, DTensor):
            w1, w2 = w1.to_local(), w2.to_local()
        first = 0
        if self.ep_mesh is not None:
            group = self.ep_mesh.get_group()
            first = self.ep_mesh.get_local_rank() * w1.shape[0]
            tokens = funcol.all_gather_single_autograd(tokens, 0, group)
            expert = funcol.all_gather_single(expert, 0, group)
        out = torch.zeros_like(tokens)
        for e in range(w1.shape[0]):
            routed = (expert == first + e).unsqueeze(-1).to(tokens.dtype)
            out = out + routed * (F.silu(tokens @ w1[e]) @ w2[e])
        if self.ep_mesh is not None:
            out = funcol.reduce_scatter_single_autograd(out, "sum", 0, self.ep_mesh.get_group())
        return out


class MoE(nn.Module):
    """Top-1 routing over :class:`GroupedExperts`; the router is a dense layer."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = GroupedExperts(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        score, expert = self.router(tokens).softmax(-1).max(-1)
        return self.experts(tokens * score.unsqueeze(-1), expert).reshape(x.shape)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, moe: bool) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim)
        self.feed_forward = MoE(args) if moe else FeedForward(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it (missing pieces are ``None``)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(args.vocab, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args, i in args.moe_layers) for i in range(args.n_layers)})
        self.norm: nn.Module | None = RMSNorm(args.dim)
        self.output: nn.Module | None = nn.Linear(args.dim, args.vocab, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def build_stage(
    args: ModelArgs, stage: int, n_stages: int, *, layers: Sequence[int] | None = None, seed: int = 0
) -> Transformer:
    """Builds the whole model from ``seed`` and keeps what stage ``stage`` of ``n_stages`` owns.

    The first stage also owns the input embedding, the last the final norm
    and output head; ``layers`` are the stage's layer ids (default: an even
    split, in order).
    """
    if layers is None:
        if args.n_layers % n_stages:
            raise ValueError(f"{args.n_layers} layers do not split evenly into {n_stages} stages")
        per_stage = args.n_layers // n_stages
        layers = range(stage * per_stage, (stage + 1) * per_stage)
    torch.manual_seed(seed)
    model = Transformer(args)
    keep = {str(i) for i in layers}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != n_stages - 1:
        model.norm = None
        model.output = None
    return model


def named_grads(*modules: nn.Module) -> dict[str, torch.Tensor | None]:
    """``{parameter name: .grad}`` of every parameter of ``modules``, as a trainer would pass them."""
    return {name: p.grad for m in modules for name, p in m.named_parameters()}


def named_parameters(*modules: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for m in modules for name, p in m.named_parameters()}


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Tensor + sequence parallelism with torchtitan's plan (activations between layers are sequence-sharded)."""
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.output is not None:
        plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    parallelize_module(model, tp_mesh, plan)
    to_replicated = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for block in model.layers.values():
        if isinstance(block.feed_forward, MoE):
            raise NotImplementedError("this test model runs MoE layers without TP")
        layer_plan = {
            "attention_norm": SequenceParallel(),
            "attention": to_replicated,
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": to_replicated,
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, tp_mesh, layer_plan)


def apply_ep(model: Transformer, ep_mesh: DeviceMesh) -> None:
    """Shards every MoE layer's experts on the expert dim over ``ep_mesh`` (torchtitan's ExpertParallel)."""
    for block in model.layers.values():
        if isinstance(block.feed_forward, MoE):
            experts = block.feed_forward.experts
            for name, p in list(experts.named_parameters()):
                experts.register_parameter(name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)])))
            experts.ep_mesh = ep_mesh


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, expert_dp_mesh: DeviceMesh | None = None) -> None:
    """FSDP2 per block and at the root; a 2-D ``dp_mesh`` (replicate, shard) gives HSDP.

    MoE experts are sharded over ``expert_dp_mesh`` (torchtitan's
    ``dp_shard_mod_ep``), the rest of the model over ``dp_mesh``.
    """
    for block in model.layers.values():
        if isinstance(block.feed_forward, MoE) and expert_dp_mesh is not None:
            fully_shard(block.feed_forward.experts, mesh=expert_dp_mesh, reshard_after_forward=False)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)


def apply_ddp(model: Transformer, dp_mesh: DeviceMesh) -> nn.Module:
    """Plain DDP over ``dp_mesh``: the gradients stay replicated plain tensors."""
    return nn.parallel.DistributedDataParallel(model, process_group=dp_mesh.get_group())


def batch(args: ModelArgs, dp_rank: int, size: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token labels for one data-parallel rank (the same on all its TP/PP peers)."""
    g = torch.Generator().manual_seed(1000 * seed + dp_rank)
    tokens = torch.randint(0, args.vocab, (size, args.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def run_pipeline(
    modules: list[nn.Module],
    stage_ids: list[int],
    n_stages: int,
    pp_mesh: DeviceMesh,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    n_microbatches: int = 2,
    schedule_cls: type = ScheduleGPipe,
) -> None:
    """One forward/backward step: ``schedule_cls`` (GPipe, 1F1B) for one stage per rank, interleaved 1F1B for more."""
    device = torch.device("cpu")
    group = pp_mesh.get_group()
    stages = [PipelineStage(m, i, n_stages, device, group=group) for m, i in zip(modules, stage_ids)]
    if len(stages) == 1:
        schedule = schedule_cls(stages[0], n_microbatches, loss_fn=_loss)
    else:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=_loss)
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids
    if first:
        schedule.step(tokens, target=labels if last else None)
    elif last:
        schedule.step(target=labels)
    else:
        schedule.step()
