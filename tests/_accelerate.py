"""Hugging Face Accelerate's own ``Accelerator`` with FSDP2 and a ``ParallelismConfig``, on gloo CPU ranks.

:func:`build` does, on each rank, what an Accelerate training script does
before its clip: a ``ParallelismConfig``, an ``Accelerator`` with an FSDP2
plugin (``torch_device_mesh`` is Accelerate's mesh), a model (tensor
parallel, with ``tp``, before ``accelerator.prepare``, as Accelerate
requires), ``accelerator.prepare(model, optimizer)`` (``fully_shard`` over
Accelerate's ``dp_shard_cp``/``dp_replicate`` dims, its context-parallel
hooks with ``cp``), one forward under ``accelerator.maybe_context_parallel``
and ``accelerator.backward``.

Accelerate 1.15 targets GPUs; three run-time adjustments make it run on
CPU ranks, each the least that does (no file of Accelerate is edited):

* ``PartialState``'s distributed type is set to ``MULTI_GPU`` before the
  ``Accelerator`` is built: ``AcceleratorState`` selects FSDP only for
  accelerator device types (``MULTI_CPU`` is not in its list, state.py),
  and ``ParallelismConfig`` refuses ``MULTI_CPU`` without FSDP. The device
  stays ``cpu`` and the process group gloo.
* Accelerate's tensor parallelism expects a ``transformers`` model
  (``from_pretrained(..., tp_plan="auto")``): ``TorchTensorParallelConfig``
  checks that transformers >= 4.52 is installed, and ``_prepare_tp`` imports
  ``transformers.integrations.tensor_parallel.ReplicateParallel`` to
  replicate the parameters a TP plan left plain. Without transformers, the
  TP plan is torch's ``parallelize_module`` (every parameter becomes a
  DTensor, so ``ReplicateParallel`` is never used), the config is built
  without its version check, and ``ReplicateParallel`` is a stand-in, in
  ``sys.modules`` during ``prepare`` only, that raises if it is ever used.
  With transformers installed, its own are used; transformers 5.23.0 no
  longer has ``ReplicateParallel`` (its TP styles moved to
  ``transformers.distributed``), so with that release Accelerate 1.15.0's
  FSDP2 + TP ``prepare`` raises ``ImportError`` for any model
  (docs/accelerate.md), and the stand-in is put on its module during
  ``prepare`` as above.
* Context parallelism's ring attention has no CPU kernel (torch 2.13:
  ``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default
  does not have a sharding strategy registered``), so the ``cp`` layout's
  forward runs under Accelerate's ``maybe_context_parallel`` (the batch
  split along the sequence) with a token-local gate in the attention's
  place, through the same weights: every parameter gets its gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests._trainer_checks import as_launched_worker

ACCELERATE_VERSION = "1.15.0"
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
CP_ATTENTION_ON_CPU = (
    "context parallelism's attention does not run on CPU: torch's context_parallel (2.13.0, 2.14.1) raises "
    "NotImplementedError (aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy); "
    "the cp layout's mesh, its FSDP2 gradients after a step under accelerator.maybe_context_parallel "
    "(a token-local gate in the attention's place) and the clip's call site are tested instead"
)

VOCAB, DIM, HIDDEN, HEAD_DIM, LAYERS, BATCH, SEQ = 32, 16, 24, 4, 2, 2, 8


class TinyLM(nn.Module):
    """Embedding, ``LAYERS`` blocks of causal attention and an MLP (residual), a linear head: Linear layers only.

    With ``attention = False``, a token-local gate takes the attention's place, through the same weights.
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "wq": nn.Linear(DIM, DIM, bias=False),
                    "wk": nn.Linear(DIM, DIM, bias=False),
                    "wv": nn.Linear(DIM, DIM, bias=False),
                    "wo": nn.Linear(DIM, DIM, bias=False),
                    "w1": nn.Linear(DIM, HIDDEN),
                    "w2": nn.Linear(HIDDEN, DIM),
                }
            )
            for _ in range(LAYERS)
        )
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.attention = True

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        batch, seq = tokens.shape
        for layer in self.layers:
            if self.attention:
                q, k, v = (layer[n](h).view(batch, seq, -1, HEAD_DIM).transpose(1, 2) for n in ("wq", "wk", "wv"))
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, -1)
            else:  # a token-local gate in its place, through the same weights (see the module docstring)
                a = layer["wv"](h) * torch.sigmoid(layer["wq"](h) * layer["wk"](h))
            h = h + layer["wo"](a)
            h = h + layer["w2"](torch.relu(layer["w1"](h)))
        return self.head(h)


def tp_plan() -> dict[str, Any]:
    """torchtitan's plan for a llama block, on ``TinyLM``: heads and the MLP's hidden dim split over ``tp``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(LAYERS):
        plan.update({f"layers.{i}.{n}": ColwiseParallel() for n in ("wq", "wk", "wv", "w1")})
        plan.update({f"layers.{i}.{n}": RowwiseParallel() for n in ("wo", "w2")})
    return plan


@dataclasses.dataclass(frozen=True)
class Layout:
    """One ``ParallelismConfig`` (its sizes multiply to the world size)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1

    def parallelism_config(self) -> Any:
        from accelerate import ParallelismConfig

        sizes = {"dp_replicate_size": self.dp_replicate, "dp_shard_size": self.dp_shard, "cp_size": self.cp}
        if self.tp > 1 and not HAS_TRANSFORMERS:
            from accelerate.utils import TorchTensorParallelConfig

            handler = object.__new__(TorchTensorParallelConfig)  # its __post_init__ only checks versions
            handler.enable_async_tp = False
            return ParallelismConfig(**sizes, tp_size=self.tp, tp_handler=handler)
        return ParallelismConfig(**sizes, tp_size=self.tp)


@dataclasses.dataclass
class Built:
    """A prepared model after one step on this rank."""

    accelerator: Any
    model: nn.Module
    optimizer: Any


class ReplicateParallelStandIn:
    """Stands in for transformers' ``ReplicateParallel`` while ``prepare`` imports it; never to be used."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("Accelerate used ReplicateParallel: a parameter was left out of the TP plan")


@contextlib.contextmanager
def _transformers_tp_import() -> Iterator[None]:
    """``transformers.integrations.tensor_parallel.ReplicateParallel`` importable, when transformers is not,
    or is a release without it (transformers 5.23.0 no longer has the name Accelerate 1.15.0 imports)."""
    if HAS_TRANSFORMERS:
        import transformers.integrations.tensor_parallel as tensor_parallel

        if hasattr(tensor_parallel, "ReplicateParallel"):
            yield
            return
        tensor_parallel.ReplicateParallel = ReplicateParallelStandIn
        try:
            yield
        finally:
            del tensor_parallel.ReplicateParallel
        return
    names = ("transformers", "transformers.integrations", "transformers.integrations.tensor_parallel")
    assert not any(n in sys.modules for n in names)
    modules = {n: types.ModuleType(n) for n in names}
    modules[names[-1]].ReplicateParallel = ReplicateParallelStandIn
    sys.modules.update(modules)
    try:
        yield
    finally:
        for n in names:
            del sys.modules[n]


def new_accelerator(layout: Layout, **kwargs: Any) -> Any:
    """A fresh ``Accelerator`` with FSDP2 and ``layout``'s ``ParallelismConfig``, on this CPU rank."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    as_launched_worker(dist.get_rank(), dist.get_world_size())
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState(cpu=True)  # joins the gloo process group the harness started
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU  # see the module docstring
    accelerator = Accelerator(
        cpu=True,
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
        parallelism_config=layout.parallelism_config(),
        **kwargs,
    )
    assert accelerator.is_fsdp2 and accelerator.device.type == "cpu", (accelerator.distributed_type, accelerator.device)
    return accelerator


def build(layout: Layout, seed: int = 0, grad_scale: float | None = None, attention: bool | None = None) -> Built:
    """``TinyLM`` prepared by Accelerate for ``layout``, after one forward/backward; the same on every call.

    ``grad_scale``: the backward goes through a ``GradScaler`` with this
    scale, as Accelerate's fp16 mixed precision on a GPU (``get_fsdp2_grad_scaler``;
    Accelerate refuses fp16 on CPU, so the scaler and the state that says
    fp16 are set after ``prepare``, the forward staying fp32).
    ``attention``: whether the forward runs the model's attention; by
    default, unless the layout has ``cp`` (see the module docstring).
    """
    accelerator = new_accelerator(layout)
    mesh = accelerator.torch_device_mesh
    torch.manual_seed(seed)
    model = TinyLM()
    if layout.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh["tp"], tp_plan())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with _transformers_tp_import():
        model, optimizer = accelerator.prepare(model, optimizer)
    if grad_scale is not None:
        accelerator.state._mixed_precision = "fp16"
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=grad_scale)
    # Each data-parallel rank its own batch; the ranks of one tp or cp group the same (cp splits it by sequence).
    data_rank = mesh["dp"].get_local_rank()  # "dp": Accelerate's data-parallel dims, flattened
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 * seed + data_rank))
    model.attention = layout.cp == 1 if attention is None else attention
    cp = {"buffers": [tokens], "buffer_seq_dims": [1], "no_restore_buffers": {tokens}}
    with accelerator.maybe_context_parallel(**cp) if layout.cp > 1 else contextlib.nullcontext():  # it warns without
        assert tokens.shape[1] == SEQ // layout.cp, tokens.shape  # cp: this rank's part of the sequence
        loss = model(tokens).float().square().mean()
        accelerator.backward(loss)
    return Built(accelerator, model, optimizer)
