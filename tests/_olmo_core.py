"""OLMo-core 3.0.0's own train modules on gloo CPU ranks: whether it runs here, its build, one step.

:func:`build` does on each rank what an OLMo-core training script does
before its first ``optim_step()``: a tiny model from ``TransformerConfig``
(``olmo2_1M``, or a small MoE from ``llama_like_moe``) built on the meta
device, and ``TransformerTrainModuleConfig(...).build(model)``, which calls
OLMo-core's ``build_world_mesh``, splits the pipeline stages and applies its
parallelisms (TP, CP, EP, FSDP/HSDP/DDP). Then one step: a real
forward/backward through ``train_batch`` where OLMo-core's forward runs on a
CPU, otherwise gradients set on every parameter, in its layout, from a
float64 draw keyed by the parameter's name (:attr:`Layout.forward_blocker`
says what stops the forward).

The test process never imports OLMo-core: the ranks do, through
:func:`import_olmo_core`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import sys
import types
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

OLMO_CORE_VERSION = "3.0.0"
DIST_NAME = "ai2-olmo-core"
VOCAB = 64
SEQ = 8


def skip_reason() -> str | None:
    """Why OLMo-core cannot be tested here (not installed, or it refuses the running torch), or None."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    try:
        version = importlib.metadata.version(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        return (
            f"{DIST_NAME} is not installed (pip install --no-deps {DIST_NAME}=={OLMO_CORE_VERSION}: see the Makefile)"
        )
    torch_version = Version(torch.__version__).base_version
    for line in importlib.metadata.requires(DIST_NAME) or []:
        req = Requirement(line)
        if req.name == "torch" and req.marker is None and not req.specifier.contains(torch_version):
            return f"{DIST_NAME} {version} requires torch{req.specifier}; torch {torch.__version__} is installed"
    return None


def _stub_cached_path() -> None:
    """Lets OLMo-core import where ``cached_path`` cannot: its cloud SDKs (boto3, google-cloud-storage,
    huggingface-hub) are not installed for these tests. OLMo-core imports it at module level to read
    files at URLs, which these tests never do; a local path is returned as itself, as ``cached_path``
    does, and anything else raises."""
    try:
        import cached_path
    except ImportError as e:
        missing = str(e)

        def cached_path(path: Any, *args: Any, **kwargs: Any) -> Path:
            if "://" in str(path) or not Path(path).exists():
                raise RuntimeError(f"cached_path is not usable in these tests ({missing}): {path}")
            return Path(path)

        class SchemeClient:
            recoverable_errors: tuple[type[BaseException], ...] = ()

        class S3Client(SchemeClient):
            pass

        module = types.ModuleType("cached_path")
        schemes = types.ModuleType("cached_path.schemes")
        module.cached_path = cached_path  # type: ignore[attr-defined]
        schemes.SchemeClient, schemes.S3Client = SchemeClient, S3Client  # type: ignore[attr-defined]
        schemes.add_scheme_client = lambda client: None  # type: ignore[attr-defined]
        module.schemes = schemes  # type: ignore[attr-defined]
        sys.modules["cached_path"], sys.modules["cached_path.schemes"] = module, schemes


def import_olmo_core(name: str = "olmo_core") -> Any:
    """Imports an OLMo-core module (on a rank)."""
    _stub_cached_path()
    return importlib.import_module(name)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One OLMo-core parallelism configuration on 4 ranks."""

    pp: int = 1
    dp: str = "fsdp"  # OLMo-core's DataParallelType: fsdp, hsdp or ddp
    num_replicas: int | None = None  # HSDP
    tp: int = 1
    cp: int = 1
    ep: int = 1
    moe: bool = False

    @property
    def forward_blocker(self) -> str | None:
        """What stops OLMo-core's forward/backward of this layout on gloo CPU ranks, or None."""
        if self.pp > 1:
            return (
                "OLMo-core's pipeline schedules cannot step on a CPU: PipelineSchedule accepts only its custom "
                "schedules (CustomInterleaved1F1B, Custom1F1BV), whose _initialize_stages calls "
                "torch.cuda.current_device()"
            )
        if self.moe:
            return "OLMo-core's MoE forward (ops/moe.py binned_gather) needs its triton kernels (olmo_core.kernels)"
        if self.cp > 1:
            return (
                "OLMo-core's ring CP is refused by its CPU attention backend (TorchAttentionBackend); its Ulysses "
                "CP forward did not finish on 4 gloo ranks (an FSDP all-gather timed out)"
            )
        return None


@dataclasses.dataclass
class Built:
    """A train module after one step, with what it holds."""

    layout: Layout
    module: Any  # TransformerTrainModule or TransformerPipelineTrainModule
    olmo_class: type  # its OLMo-core class, whose _clip_grad_norm is OLMo-core's
    trainer: FakeTrainer

    @property
    def model_parts(self) -> list[nn.Module]:
        return list(getattr(self.module, "model_parts", None) or [self.module.model])

    def named_grads(self) -> dict[str, torch.Tensor | None]:
        return {n: p.grad for m in self.model_parts for n, p in m.named_parameters()}

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(getattr(self.module, "optimizers", None) or [self.module.optim])


class FakeTrainer:
    """What a train module reads of OLMo-core's ``Trainer`` in ``train_batch`` and ``optim_step``: metrics kept."""

    def __init__(self, module: Any, global_batch_size: int) -> None:
        self.module = module
        self.global_batch_size = global_batch_size
        self.metrics: dict[str, Any] = {}

    @property
    def dp_process_group(self) -> Any:
        return self.module.dp_process_group

    def record_metric(self, name: str, value: Any, reduce_type: Any = None, namespace: Any = None, **kw: Any) -> None:
        self.metrics[f"{namespace}/{name}" if namespace else name] = value

    def record_ce_loss(self, value: Any, reduce_type: Any = None) -> None:
        self.metrics["train/CE loss"] = value


def build(layout: Layout) -> Built:
    """Layout ``layout`` built by OLMo-core's config on this rank, after one step (see the module docstring)."""
    parallel = import_olmo_core("olmo_core.distributed.parallel")
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import SkipStepAdamWConfig
    from olmo_core.train.train_module import TransformerTrainModuleConfig
    from olmo_core.train.train_module.transformer.config import (
        TransformerContextParallelConfig,
        TransformerDataParallelConfig,
        TransformerExpertParallelConfig,
        TransformerPipelineParallelConfig,
        TransformerTensorParallelConfig,
    )

    # build_world_mesh may run once per process ("world mesh already exists"); these ranks build several.
    parallel._WORLD_MESH = None
    if layout.moe:
        config = TransformerConfig.llama_like_moe(
            d_model=16, vocab_size=VOCAB, n_layers=4, n_heads=2, num_experts=4, top_k=2, expert_hidden_size=16
        )
    else:
        config = TransformerConfig.olmo2_1M(vocab_size=VOCAB, n_layers=4)
    kwargs: dict[str, Any] = {
        "dp_config": TransformerDataParallelConfig(
            name=parallel.DataParallelType(layout.dp),
            num_replicas=layout.num_replicas,
            shard_degree=None if layout.num_replicas is None else 4 // (layout.pp * layout.num_replicas),
        )
    }
    if layout.tp > 1:
        kwargs["tp_config"] = TransformerTensorParallelConfig(degree=layout.tp)
    if layout.cp > 1:
        kwargs["cp_config"] = TransformerContextParallelConfig.ulysses(degree=layout.cp)
    if layout.ep > 1:
        kwargs["ep_config"] = TransformerExpertParallelConfig(degree=layout.ep)
    if layout.pp > 1:
        kwargs["pp_config"] = TransformerPipelineParallelConfig(
            degree=layout.pp,
            schedule=parallel.PipelineScheduleType.custom_interleaved_1F1B,
            use_custom_stage_implementation=True,
        )
    model = config.build(init_device="meta")
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * SEQ,
        max_sequence_length=SEQ,
        optim=SkipStepAdamWConfig(lr=1e-3),
        max_grad_norm=1.0,
        **kwargs,
    ).build(model, device=torch.device("cpu"))
    trainer = FakeTrainer(module, global_batch_size=2 * SEQ * 4)
    module._attach_trainer(trainer)
    built = Built(layout, module, type(module), trainer)
    if layout.forward_blocker is None:
        torch.manual_seed(0)  # the same batch on every rank: its replicas' gradients agree bit for bit
        module.train_batch({"input_ids": torch.randint(0, VOCAB, (2, SEQ))})
    else:
        set_grads(built)
    return built


def set_grads(built: Built) -> None:
    """Sets every parameter's gradient, in the parameter's layout, from a draw keyed by its name.

    The draws are distinct per parameter (scaled 1 to 7 by name, so that the stages' norms differ) and
    identical on every rank that holds the parameter, as a reduced gradient is.
    """
    for part in built.model_parts:
        for name, p in part.named_parameters():
            seed = zlib.crc32(name.encode())
            full = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
            full = (full * (1 + seed % 7)).to(p.dtype)
            if isinstance(p, DTensor):
                p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            else:
                p.grad = full
