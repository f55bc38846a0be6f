"""torchtitan's own models and parallelisms on gloo CPU ranks: the run-time patches, the build, one step.

:func:`train_step` does, on each rank, what torchtitan 0.3.0's ``Trainer``
does before its clip (``torchtitan/trainer.py``), calling torchtitan for
every part: ``ParallelDims(...).build_mesh()``, a model from torchtitan's
model registry built on the meta device, ``pipeline_llm`` (1F1B) or the
model's ``parallelize_fn`` alone (TP, EP, then ``fully_shard``), weights
initialized by the model, torchtitan's cross-entropy loss, and one
forward/backward through the pipeline schedule the way the trainer calls it.

torchtitan targets CUDA and a newer torch; :func:`patch_torchtitan` makes it
run on CPU with gloo and torch 2.13 or 2.14 without editing site-packages.
The test process imports this module but never torchtitan: the ranks apply
the patches before their first torchtitan import.

SPMD backends: torchtitan 0.3.0's default, ``"spmd_types"`` (parameters
``fully_shard`` over plain-tensor modules, typed by ``spmd_types``), needs
torch >= 2.14: under torch 2.13 its ``fully_shard`` fails ("all parameters
must be DTensors on the full SPMD mesh"), so those layouts skip there, saying
so. ``"full_dtensor"`` runs on both, ``"partial_dtensor"`` (the legacy
backend) too.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

TORCHTITAN_VERSION = "0.3.0"
TORCH_2_14 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)

# torchtitan 0.3.0 requires Python >= 3.11: there the Makefile installs it and a test that imports it fails
# without it; on 3.10 it is not installed and those tests skip, saying so.
needs_torchtitan = pytest.mark.skipif(
    sys.version_info < (3, 11), reason=f"torchtitan {TORCHTITAN_VERSION} requires Python >= 3.11 (not installed here)"
)

MODELS = ("llama3", "qwen3_moe")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One torchtitan parallelism configuration (its ``ParallelismConfig`` degrees and SPMD backend)."""

    model: str
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    # torchtitan's default is "spmd_types" (torch >= 2.14: see :meth:`skip_reason`); "partial_dtensor" is
    # the legacy backend.
    spmd_backend: str = "full_dtensor"

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model {self.model!r} is not one of {MODELS}")

    def skip_reason(self) -> str | None:
        """Why this layout cannot run with the installed torch, or None."""
        if not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
            return (
                f"torchtitan {TORCHTITAN_VERSION}'s parallelize code imports torch.distributed.fsdp."
                f"DataParallelMeshDims, which torch {torch.__version__} does not have (torch >= 2.12)"
            )
        if self.model == "qwen3_moe" and not _dtensor_scatter_keeps_shard():
            return (
                f"torchtitan {TORCHTITAN_VERSION}'s MoE router writes its routing map with an in-place scatter_ "
                f"on a token-sharded DTensor, which torch {torch.__version__}'s DTensor refuses ('in-place "
                "operations that require placement changes are not supported'; torch >= 2.13 keeps the Shard)"
            )
        if self.spmd_backend == "spmd_types" and not TORCH_2_14:
            return (
                f"torchtitan's spmd_types backend needs torch >= 2.14 (torch {torch.__version__}'s fully_shard "
                "fails: 'all parameters must be DTensors on the full SPMD mesh')"
            )
        return None


@functools.cache
def _dtensor_scatter_keeps_shard() -> bool:
    """Whether DTensor runs ``scatter_`` along a replicated dim of a ``Shard(0)`` tensor as a local op.

    Sharding propagation only: a two-rank mesh with no process group behind it.
    """
    mesh = DeviceMesh("cpu", [0, 1], _init_backend=False, _rank=0)
    target = DTensor.from_local(torch.zeros(2, 3, 4, dtype=torch.bool), mesh, [Shard(0)], run_check=False)
    index = DTensor.from_local(torch.zeros(2, 3, 2, dtype=torch.long), mesh, [Shard(0)], run_check=False)
    try:
        target.scatter_(-1, index, True)
    except RuntimeError:
        return False
    return True


@dataclasses.dataclass
class Trained:
    """What a torchtitan trainer holds when it reaches the clip."""

    parallel_dims: Any  # torchtitan.distributed.ParallelDims
    model_parts: list[nn.Module]

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """``{name in the whole model: parameter}`` of this rank's model parts."""
        return {name: p for m in self.model_parts for name, p in m.named_parameters()}

    def named_grads(self) -> dict[str, torch.Tensor | None]:
        return {name: p.grad for name, p in self.named_parameters().items()}


# ---------------------------------------------------------------------------------------------
# Run-time patches
# ---------------------------------------------------------------------------------------------

_PATCHED = False


def _stub_module(name: str, why: str, **attrs: Any) -> None:
    """Puts a module called ``name`` in ``sys.modules`` whose unknown attributes raise when used."""

    def missing(attr: str) -> Any:
        if attr.startswith("__"):  # inspect and pickle probe module dunders: not there, as for a real module
            raise AttributeError(attr)

        def unavailable(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"{name}.{attr} is a test stub ({why})")

        return unavailable

    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules[name] = module


def patch_torchtitan() -> None:
    """Makes torchtitan 0.3.0 importable and runnable on CPU gloo ranks under torch 2.13 (once per process).

    Must run before anything imports torchtitan: modules bind
    ``device_type`` when they are first imported.

    Raises:
        RuntimeError: torchtitan was imported before the patches.
    """
    global _PATCHED
    if _PATCHED:
        return
    if any(name == "torchtitan.distributed" or name.startswith("torchtitan.models") for name in sys.modules):
        raise RuntimeError("torchtitan was imported before patch_torchtitan(); its device_type is already bound")

    # Only MinimalAsyncEP's CUDA kernels import triton (not installed on CPU); the standard EP dispatcher is used.
    _stub_module("torchtitan.distributed.minimal_async_ep.kernels", "triton kernels, CUDA only")

    # torchtitan.trainer imports torchdata, tensorboard and tokenizers; the model configs only test isinstance on it.
    class Trainer:
        class Config:  # nothing is an instance: update_from_config takes its documented non-trainer path
            pass

    _stub_module("torchtitan.trainer", "the trainer needs torchdata", Trainer=Trainer)

    try:
        import torchtitan.tools.utils
    except ModuleNotFoundError as e:
        raise RuntimeError(
            f"torchtitan=={TORCHTITAN_VERSION} is a test dependency (`make test` installs it with --no-deps): {e}"
        ) from e

    # Without a GPU torchtitan still picks "cuda" for its meshes; parallel_dims binds this when imported.
    torchtitan.tools.utils.device_type = "cpu"
    from torchtitan.distributed import parallel_dims

    if parallel_dims.device_type != "cpu":
        raise RuntimeError(f"torchtitan's meshes would be built on {parallel_dims.device_type!r}")

    # spmd_types exchanges expert tokens with the list form of all_to_all, which gloo refuses for uneven
    # splits ("ProcessGroupGloo::alltoall: invalid tensor size"); its own hook swaps in a dist that
    # does the same exchange with all_to_all_single.
    import spmd_types

    spmd_types.set_dist(_dist_with_all_to_all_single())
    _PATCHED = True


def _dist_with_all_to_all_single() -> types.ModuleType:
    """``torch.distributed`` whose ``all_to_all`` (the list form) runs as one ``all_to_all_single``."""

    def all_to_all(
        output_tensor_list: list[torch.Tensor],
        input_tensor_list: list[torch.Tensor],
        group: Any = None,
        async_op: bool = False,
    ) -> None:
        if async_op:
            raise NotImplementedError("async all_to_all is not routed through all_to_all_single here")
        inputs = torch.cat([t.reshape(-1) for t in input_tensor_list])
        outputs = inputs.new_empty(sum(t.numel() for t in output_tensor_list))
        dist.all_to_all_single(
            outputs,
            inputs,
            output_split_sizes=[t.numel() for t in output_tensor_list],
            input_split_sizes=[t.numel() for t in input_tensor_list],
            group=group,
        )
        for t, chunk in zip(output_tensor_list, outputs.split([t.numel() for t in output_tensor_list])):
            t.copy_(chunk.view_as(t))

    module = types.ModuleType("torch_distributed_with_all_to_all_single")
    module.all_to_all = all_to_all  # type: ignore[attr-defined]
    module.__getattr__ = lambda name: getattr(dist, name)  # type: ignore[method-assign]
    return module


def _sdpa_attention(model_config: Any) -> None:
    """Swaps FlexAttention (no backward on CPU) for torchtitan's SDPA, as its graph-trainer tests do."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()


def _sum_reductions(model_parts: list[nn.Module]) -> None:
    """torchtitan sets gradient_divide_factor=1, which FSDP reduces with PREMUL_SUM; gloo has none: plain SUM."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def _step_microbatches(schedule: Any) -> None:
    """torch <= 2.13's ``schedule.step()`` takes a whole batch, not torchtitan's ``arg_mbs=...``: route those here.

    torch 2.14's takes ``arg_mbs``/``kwarg_mbs``/``target_mbs`` itself: not patched there. torch 2.12's
    ``_step_microbatches`` has no ``loss_kwargs`` either: those are bound into the loss function for the call.
    """
    takes_loss_kwargs = "loss_kwargs" in inspect.signature(schedule._step_microbatches).parameters

    def step(
        *,
        arg_mbs: list | None = None,
        kwarg_mbs: list | None = None,
        target_mbs: list | None = None,
        losses: list | None = None,
        loss_kwargs: dict[str, Any] | None = None,
        return_outputs: bool = True,
    ) -> None:
        # What PipelineScheduleSingle.step does around _step_microbatches, without splitting a batch.
        schedule._stage.has_backward = schedule._has_backward
        schedule._stage.clear_runtime_states()
        if takes_loss_kwargs:
            schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
            return
        loss_fn = schedule._loss_fn
        if loss_fn is not None and loss_kwargs:
            schedule._loss_fn = functools.partial(loss_fn, **loss_kwargs)
        try:
            schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs)
        finally:
            schedule._loss_fn = loss_fn

    schedule.step = step


# ---------------------------------------------------------------------------------------------
# The models, from torchtitan's registry, at test size
# ---------------------------------------------------------------------------------------------


def _model_spec(model: str) -> Any:
    """The ``ModelSpec`` a torchtitan config names, cut down to 2 layers (and 8 small experts for the MoE)."""
    if model == "llama3":
        from torchtitan.models.llama3 import model_registry

        spec = model_registry("debugmodel")
        spec.model.layers = spec.model.layers[:2]  # dim 256, vocab 2048, 16 heads: as registered
    else:
        from torchtitan.models.qwen3 import _build_qwen3_moe_layers, model_registry

        spec = model_registry("debugmodel_moe")
        # The registered 64 experts of 768 × 256 per layer are 300 M parameters; torchtitan's own
        # layer builder makes the same blocks with 8 experts (divisible by EP=2 and 4), top-2, fewer heads.
        spec.model.layers = _build_qwen3_moe_layers(
            n_layers=2,
            dim=spec.model.dim,
            n_heads=4,
            n_kv_heads=2,
            head_dim=32,
            moe_hidden_dim=64,
            num_experts=8,
            top_k=2,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=dataclasses.replace(spec.model.layers[0].attention.rope, dim=32),
        )
    _sdpa_attention(spec.model)
    return spec


# ---------------------------------------------------------------------------------------------
# Build and one step, as torchtitan's Trainer does
# ---------------------------------------------------------------------------------------------

LOCAL_BATCH = 2  # sequences per data-parallel rank: 2 pipeline microbatches of 1
SEQ_LEN = 16


def train_step(layout: Layout) -> Trained:
    """Builds ``layout`` with torchtitan on this rank, runs one forward/backward, and returns the model parts."""
    patch_torchtitan()
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=layout.dp_replicate,
        data_parallel_shard_degree=layout.dp_shard,
        tensor_parallel_degree=layout.tp,
        pipeline_parallel_degree=layout.pp,
        expert_parallel_degree=layout.ep,
        pipeline_parallel_schedule="1F1B",
        spmd_backend=layout.spmd_backend,
    )
    # fp32 params: the reference is whatever gradient the step made, and CPU bf16 matmuls are slow.
    training = TrainingConfig(local_batch_size=LOCAL_BATCH, seq_len=SEQ_LEN, mixed_precision_param="float32")
    # Meshes compare equal to an earlier build's in this process, and DTensor's sharding-propagation
    # cache would hand back that build's mesh objects, which full_dtensor's fully_shard rejects.
    _clear_sharding_prop_cache()
    parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    parallel_dims.build_mesh()
    dist_utils.set_spmd_backend(layout.spmd_backend)

    spec = _model_spec(layout.model)
    model_config = spec.model
    model_config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism, training=training))
    torch.manual_seed(0)  # the same initial weights on every rank
    with torch.device("meta"):
        model = model_config.build()
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=model_config.vocab_size).build()
    common = {
        "parallel_dims": parallel_dims,
        "training": training,
        "parallelism": parallelism,
        "compile_config": CompileConfig(),
        "ac_config": None,
        "dump_folder": "",
    }
    if parallel_dims.pp_enabled:
        schedule, model_parts, has_first, has_last = spec.pipelining_fn(
            model,
            **common,
            device=torch.device("cpu"),
            model_config=model_config,
            parallelize_fn=spec.parallelize_fn,
            loss_fn=loss_fn,
        )
        if not TORCH_2_14:
            _step_microbatches(schedule)
    else:
        model_parts = [spec.parallelize_fn(model, **common)]
    for m in model_parts:
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.init_weights(buffer_device=None)
        m.train()
    _sum_reductions(model_parts)

    inputs, labels = _batch(parallel_dims, model_config.vocab_size)
    local_valid_tokens = torch.tensor(labels.numel())
    if parallel_dims.dp_enabled:
        global_valid_tokens = dist_utils.dist_sum_tensor(local_valid_tokens, parallel_dims.get_mesh("batch"))
    else:
        global_valid_tokens = local_valid_tokens
    train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    if parallel_dims.pp_enabled:
        microbatches = [_trainer_inputs(parallel_dims, layout, x, y) for x, y in _microbatches(inputs, labels)]
        with train_context():
            schedule.step(
                arg_mbs=[(x,) for x, _ in microbatches] if has_first else None,
                kwarg_mbs=[{} for _ in microbatches],
                target_mbs=[y for _, y in microbatches] if has_last else None,
                losses=[] if has_last else None,
                loss_kwargs={"global_valid_tokens": global_valid_tokens},
                return_outputs=False,
            )
    else:
        x, y = _trainer_inputs(parallel_dims, layout, inputs, labels)
        with train_context():
            loss, _ = loss_fn(model_parts[0](x), y, global_valid_tokens)
            loss.backward()
    return Trained(parallel_dims, model_parts)


def _batch(parallel_dims: Any, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's token batch: the same on the TP and pipeline ranks that share it."""
    batch_mesh = parallel_dims.get_optional_mesh("batch")
    batch_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
    g = torch.Generator().manual_seed(1000 + batch_rank)
    tokens = torch.randint(0, vocab, (LOCAL_BATCH, SEQ_LEN + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _microbatches(inputs: torch.Tensor, labels: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    yield from zip(inputs.split(1), labels.split(1))


def _trainer_inputs(parallel_dims: Any, layout: Layout, inputs: torch.Tensor, labels: torch.Tensor) -> tuple:
    """The trainer's ``post_dataloading_process``: inputs and labels become DTensors, or get their SPMD types."""
    if layout.spmd_backend == "full_dtensor":
        from torchtitan.distributed import full_dtensor

        inputs, labels, _ = full_dtensor.parallelize_inputs(parallel_dims, inputs, labels, {})
    elif layout.spmd_backend == "spmd_types":
        from torchtitan.distributed.spmd_types import annotate_input_spmd_types

        inputs, labels, _ = annotate_input_spmd_types(parallel_dims, inputs, labels, {})
    return inputs, labels
