"""Steady-state cost of the static-option agreement check (issue 26): clip time with vs without it.

One gloo rank (world group of 1, so the collective is real but local), 100
plain fp32 leaves of 4096 with a group per leaf (the largest ``repr`` to hash
per call); the check is switched off by making ``_agree.check_agree`` a no-op.
Run: ``python -m bench.agree_cost``.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ppclip_func._measure as measure_mod
from ppclip_func import clip_grad_norm_


def _time(fn, n: int = 200) -> float:
    for _ in range(20):
        fn()
    best = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t) / n)
    return min(best)


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.zeros(4096)) for _ in range(100)]
    for p in params:
        p.grad = torch.randn(4096)
    for label, groups in (("no groups", None), ("100 groups", {str(i): str(i) for i in range(100)})):
        named = dict(zip(map(str, range(100)), params, strict=True))

        def clip(groups=groups, named=named):
            return clip_grad_norm_(named, mesh, 1e9, groups=groups)

        real = measure_mod.check_agree
        with_check = _time(clip)
        measure_mod.check_agree = lambda *a, **k: None
        without = _time(clip)
        measure_mod.check_agree = real
        with_check2 = _time(clip)
        w = min(with_check, with_check2)
        print(f"{label}: with check {w * 1e6:.1f} us, without {without * 1e6:.1f} us, ratio {w / without:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
