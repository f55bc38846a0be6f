"""Demo: the global gradient norm of a pipeline-parallel × FSDP model, three ways.

Run on 4 CPU ranks (gloo)::

    torchrun --standalone --nproc-per-node 4 -m ppclip_func.demo

The world mesh is ``("pp", "dp") = (2, 2)``: two pipeline stages, each an
MLP sharded with FSDP2 (``fully_shard``: ``Shard(0)`` DTensors) over ``dp``. After a
real backward pass on every stage (each stage gets its own loss, so this demo
needs no pipeline schedule), rank 0 prints the norm that
``torch.nn.utils.clip_grad_norm_`` sees on each stage (the stage-local norm,
the bug of torchtitan#596), the norm ``ppclip_func.clip_grad_norm_`` returns
(one collective), and a float64 reference gathered from the whole model. The
demo exits non-zero if ours and the reference differ by more than 1e-6.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ppclip_func import clip_grad_norm_


def _stage_model(stage: int, dp_mesh) -> torch.nn.Module:
    torch.manual_seed(stage)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    return fully_shard(model, mesh=dp_mesh)  # FSDP2: Shard(0) DTensor params and grads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--norm-type", type=float, default=2.0)
    args = parser.parse_args(argv)

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("pp", "dp"))
        stage = mesh.get_coordinate()[0]
        model = _stage_model(stage, mesh["dp"])
        torch.manual_seed(100 + dist.get_rank())
        x = torch.randn(8, 16)
        loss = model(x)
        loss = loss.pow(2).mean() * (10.0 if stage == 1 else 1.0)
        loss.backward()

        params = list(model.parameters())
        full = [p.grad.full_tensor().double() for p in params]
        stage_torch = torch.nn.utils.get_total_norm([p.grad for p in params], args.norm_type).full_tensor()
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (stage, full))
        by_stage = {s: f for s, f in gathered}
        ref = torch.linalg.vector_norm(
            torch.cat([t.flatten() for s in sorted(by_stage) for t in by_stage[s]]), args.norm_type
        )

        ours = clip_grad_norm_(model.parameters(), mesh, args.max_norm, args.norm_type)
        stage_norms: list = [None] * dist.get_world_size()
        dist.all_gather_object(stage_norms, (stage, float(stage_torch)))
        if dist.get_rank() == 0:
            per_stage = dict(stage_norms)
            print(f"world mesh {mesh}, norm_type={args.norm_type}")
            for s in sorted(per_stage):
                print(f"  torch.nn.utils.clip_grad_norm_ on stage {s} alone: {per_stage[s]:.6f}")
            print(f"  ppclip_func.clip_grad_norm_ (one all-reduce):   {float(ours):.6f}")
            print(f"  float64 reference over the whole model:         {float(ref):.6f}")
        rel = abs(float(ours) - float(ref)) / max(float(ref), 1e-30)
        ok = rel <= 1e-6 or (math.isinf(float(ref)) and float(ours) == float(ref))
        if dist.get_rank() == 0:
            print(f"  relative difference: {rel:.2e} -> {'OK' if ok else 'MISMATCH'}")
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
