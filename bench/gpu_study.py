"""Study 5, one GPU: study 1 on CUDA with bf16 Llama-3-8B-shaped gradients.

The same variants as :mod:`bench.bandwidth_study` (torch's eager foreach clip,
torch's clip compiled, ours eager and compiled, pure and in place), on 291
leaves and 8.03 G bf16 elements (16 GB of gradients; about 90 GB of device
memory in all, with the flat buffers of the bound and the pure API's outputs).
Each variant is reported in ms and as the fraction of the HBM bound measured
in the same run: ``flat.sum()`` plus ``flat.mul_(c)`` over one flat buffer of
the same size (``torch.mul(flat, c, out=other)`` for the pure API), timed to
``torch.cuda.synchronize()``. ``bound_GBps`` is the HBM traffic of the bound
(three passes over the buffer) per second: what this GPU reaches, to set
against its nominal peak (H100 SXM 3.35 TB/s, H200 4.8 TB/s, from NVIDIA's
data sheets).

It then runs study 9's sweep (:mod:`bench.sweep_study`) on the same device:
torch's clip and ours, eager and compiled, over leaf counts and leaf sizes,
fp32 and bf16, into ``sweep_cuda.json``.

The run is one prepared command (most of it inductor compiling)::

    python -m bench.gpu_study                 # needs CUDA; writes bench/results/gpu.json
    python -m bench.gpu_study --quick --device cpu   # smoke test: 2 small blocks, aot_eager

``python -m bench`` runs it when ``torch.cuda.is_available()``, and records
"not measured" otherwise.
"""

from __future__ import annotations

import argparse
import pathlib

import torch

from bench import bandwidth_study, sweep_study
from bench._report import RESULTS, write_result
from bench._shapes import llama3_8b_shapes

NAME = "gpu"


def run(quick: bool = False, out: pathlib.Path | None = None, device: str = "cuda", sweep: str | None = None) -> dict:
    """Measures every variant in bf16 on ``device``; writes ``<out>/gpu.json`` and returns it.

    ``sweep`` is study 9's size here: ``"full"``, ``"quick"`` or ``"none"``
    (default: quick with ``quick``, else full; the full sweep compiles 32
    points with inductor, longer than a short GPU lease).
    """
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the GPU study needs CUDA (torch.cuda.is_available() is False)")
    layers, scale = (2, 64) if quick else (32, 1)
    runs, warmup = (5, 1) if quick else (7, 2)
    backend = "aot_eager" if quick else "inductor"
    body = bandwidth_study.measure(
        llama3_8b_shapes(layers, scale), (torch.bfloat16,), device=device, runs=runs, warmup=warmup, backend=backend
    )
    body["model"]["shapes"] = f"Llama-3-8B, {layers} layers, widths / {scale}"
    result = {"study": NAME, "measured": True, "quick": quick, **body}
    if torch.device(device).type == "cuda":
        result["cpu_offload"] = _cpu_offload_check()
    # Study 9's sweep on the same device: compiled and eager, leaf counts and sizes (sweep_cuda.json).
    sweep = sweep or ("quick" if quick else "full")
    if sweep == "none":
        result["sweep"] = {"study": None, "points": 0, "why": "not run (--sweep none)"}
    else:
        swept = sweep_study.run(quick=sweep == "quick", out=out, device=device)
        result["sweep"] = {"study": swept["study"], "points": sum(len(v) for v in swept["series"].values())}
    write_result(result, out)
    return result


def _cpu_offload_check() -> dict:
    """FSDP2 CPU offload (pytorch#148532): CPU grads over a CUDA mesh must reduce on the GPU.

    Runs the unit check of ``tests/test_devices.py`` on 4 fake ranks in this
    process (a fake process group: one GPU cannot host real NCCL peers).
    """
    from tests.test_devices import offloaded_clip_reduces_on_the_gpu

    devices, total = offloaded_clip_reduces_on_the_gpu()
    return {"collective_devices": devices, "norm": total, "ok": [d.split(":")[0] for d in devices] == ["cuda"]}


def plot(result: dict, path: pathlib.Path) -> None:
    """The bandwidth study's bar chart, for the one dtype measured here."""
    bandwidth_study.plot(result, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 small blocks, aot_eager: a smoke test")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--sweep", choices=("full", "quick", "none"), help="study 9 here (default: as --quick)")
    args = parser.parse_args()
    r = run(quick=args.quick, out=args.out, device=args.device, sweep=args.sweep)
    print(f"{r['device']}: {r['model']['params'] / 1e9:.2f} G bf16 params in {r['model']['leaves']} leaves")
    bandwidth_study.print_result(r)


if __name__ == "__main__":
    main()
