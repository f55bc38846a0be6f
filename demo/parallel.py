"""How :mod:`demo.model` is parallelized: torch's own APIs, applied the way torchtitan applies them.

* :func:`apply_tp`: ``parallelize_module`` with column/row-parallel linears and
  sequence-parallel norms (activations between blocks are sequence-sharded);
* :func:`apply_fsdp`: FSDP2 ``fully_shard`` per block and at the root; a 2-D
  mesh gives HSDP, and MoE experts can be sharded over a mesh of their own;
* :func:`apply_ep`: expert parallelism (experts sharded on the expert dim);
* :func:`apply_ddp`: ``DistributedDataParallel`` (grads stay plain tensors);
* :class:`Pipeline`: this rank's stages under a ``torch.distributed.pipelining``
  schedule (GPipe, 1F1B, or interleaved 1F1B for several stages per rank).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from demo.model import MoE, Transformer, loss_fn

__all__ = ["Pipeline", "apply_ddp", "apply_ep", "apply_fsdp", "apply_tp"]


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism with sequence-parallel norms, as torchtitan does for Llama."""
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
            raise NotImplementedError("this model runs MoE layers without TP")
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
    """FSDP2 per block and at the root; parameters stay gathered between microbatches.

    A 2-D ``dp_mesh`` (replicate, shard) gives HSDP. MoE experts are sharded
    over ``expert_dp_mesh`` (torchtitan's ``dp_shard_mod_ep``) if given.
    """
    for block in model.layers.values():
        if isinstance(block.feed_forward, MoE) and expert_dp_mesh is not None:
            fully_shard(block.feed_forward.experts, mesh=expert_dp_mesh, reshard_after_forward=False)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False)


def apply_ddp(model: Transformer, dp_mesh: DeviceMesh) -> nn.Module:
    """Plain DDP over ``dp_mesh``: the gradients stay replicated plain tensors."""
    return nn.parallel.DistributedDataParallel(model, process_group=dp_mesh.get_group())


class Pipeline:
    """This rank's pipeline stages and their schedule; :meth:`step` runs one forward/backward.

    Args:
        modules: This rank's stage modules.
        stage_ids: Their stage numbers, in the same order.
        n_stages: Stages of the whole model.
        pp_mesh: The pipeline mesh (one dim).
        n_microbatches: Microbatches per step.
        schedule_cls: For one stage per rank (``ScheduleGPipe``, ``Schedule1F1B``);
            several stages per rank always run interleaved 1F1B.
        loss: ``loss(logits, targets)`` on the last stage.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        stage_ids: list[int],
        n_stages: int,
        pp_mesh: DeviceMesh,
        *,
        n_microbatches: int = 2,
        schedule_cls: type = ScheduleGPipe,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn,
    ) -> None:
        group = pp_mesh.get_group()
        device = torch.device("cpu")
        stages = [PipelineStage(m, i, n_stages, device, group=group) for m, i in zip(modules, stage_ids)]
        if len(stages) == 1:
            self.schedule = schedule_cls(stages[0], n_microbatches, loss_fn=loss)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss)
        self.first = 0 in stage_ids
        self.last = n_stages - 1 in stage_ids

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, losses: list[torch.Tensor] | None = None) -> None:
        """One forward/backward; the first stage reads ``tokens``, the last ``targets`` (and fills ``losses``)."""
        inputs = (tokens,) if self.first else ()
        if self.last:
            self.schedule.step(*inputs, target=targets, losses=losses)
        else:
            self.schedule.step(*inputs)
