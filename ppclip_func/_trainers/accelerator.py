"""The mesh an Accelerate ``Accelerator`` built, for the integrations that clip under one (Accelerate, transformers)."""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["accelerator_mesh"]

# Accelerate's DistributedType values (a str enum) whose gradients this clip does not reach, and why.
REFUSED = {
    "DEEPSPEED": "DeepSpeed clips inside its engine (Accelerate's clip only returns the engine's norm)",
    "MEGATRON_LM": "Megatron-LM clips inside its own optimizer",
    "XLA": "on XLA, Accelerate's clip all-reduces the gradients itself before clipping",
}


def accelerator_mesh(accelerator: Any) -> DeviceMesh | None:
    """The mesh of every rank that Accelerate built (``None`` without one); refuses what this clip cannot reach."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind in REFUSED:
        raise ValueError(f"ppclip_func.accelerate does not clip under {kind}: {REFUSED[kind]}; keep its own clip")
    if kind == "FSDP" and not accelerator.is_fsdp2:
        raise ValueError(
            "ppclip_func.accelerate needs FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2)): FSDP1's flat "
            "parameters are plain tensors whose sharding the clip cannot read; keep Accelerate's clip for FSDP1"
        )
    return accelerator.torch_device_mesh
