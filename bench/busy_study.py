"""The eager clip on a CPU whose other cores are busy (issue 38): ours against torch's, 1 and 2 threads.

Training loops on CPUs share cores with data loaders. A torch op over more
than ``at::internal::GRAIN_SIZE`` (32768) elements opens a parallel region
over the torch threads, and its end waits for every thread: where another
process holds a core, for the scheduler to give that thread one. torch's
foreach clip reduces and scales small leaves one at a time, each under the
grain, so it never waits; a clip that packs them into larger blocks opens a
region per op.

Each point is a gradient list (``leaves`` leaves of ``size`` elements of
``dtype``), clipped in place with ``max_norm`` large enough that the scale
is 1 (the same work every call): ``torch``, ``torch.nn.utils.
clip_grad_norm_(foreach=True)``; ``ours``, ``ppclip_func.clip_grad_norm_``
with no mesh. Both run interleaved (``bench/_timing.interleaved``) under
each condition: 1 and 2 torch threads, the machine ``idle`` (as it is) or
``busy``: one spinning process per core but the first, pinned there
(:func:`spinners`), so torch's second thread shares a core with a spinner.

    python -m bench.busy_study           # ~2 min on 2 cores
    python -m bench.busy_study --quick   # smoke run: small points, few rounds

Writes ``bench/results/busy.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import torch

from bench._report import RESULTS, write_result
from bench._timing import interleaved, machine
from ppclip_func import clip_grad_norm_

NAME = "busy"
# (dtype, leaves, elements per leaf): small leaves (bf16 and fp32, few and many), medium fp32 ones, and
# large ones (FSDP shards of 168 K, whole 1 M leaves), whose ops are over the grain in both clips.
FULL = {
    "points": [
        ("bfloat16", 16, 4096),
        ("float32", 16, 4096),
        ("bfloat16", 1000, 4096),
        ("float32", 2000, 8192),
        ("float32", 1000, 16777),
        ("float32", 100, 167772),
        ("bfloat16", 100, 167772),
        ("float32", 16, 1 << 20),
        ("bfloat16", 16, 1 << 20),
    ],
    "runs": 9,
    "calls": 2**24,  # elements clipped per timed sample (repeated calls for small points)
}
QUICK = {"points": [("bfloat16", 16, 4096), ("float32", 64, 8192)], "runs": 5, "calls": 2**20}
THREADS = (1, 2)
LOADS = ("idle", "busy")
SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def _cores() -> list[int]:
    """The cores this process may run on (Linux: spinners are pinned with ``sched_setaffinity``)."""
    return sorted(os.sched_getaffinity(0))


@contextlib.contextmanager
def spinners(busy: bool) -> Iterator[int]:
    """Keeps every core but the first busy with a spinning process pinned to it; yields how many run."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN, str(c)]) for c in _cores()[1:]] if busy else []
    try:
        yield len(procs)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _point(dtype: str, leaves: int, size: int, runs: int, calls: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    params = []
    for _ in range(leaves):
        p = torch.nn.Parameter(torch.empty(size, dtype=getattr(torch, dtype)))
        p.grad = torch.randn(size, generator=gen).to(p.dtype)
        params.append(p)
    repeat = max(1, calls // (leaves * size))

    def torch_clip() -> None:
        for _ in range(repeat):
            torch.nn.utils.clip_grad_norm_(params, 1e30, foreach=True)

    def ours() -> None:
        for _ in range(repeat):
            clip_grad_norm_(params, None, 1e30)

    out: dict = {"dtype": dtype, "leaves": leaves, "size": size, "calls_per_sample": repeat, "conditions": []}
    saved = torch.get_num_threads()
    try:
        for load in LOADS:
            with spinners(load == "busy") as spinning:
                for threads in THREADS:
                    torch.set_num_threads(threads)
                    t = interleaved({"torch": torch_clip, "ours": ours}, runs=runs, warmup=2)
                    out["conditions"].append(
                        {
                            "load": load,
                            "spinners": spinning,
                            "threads": threads,
                            "ms": {k: v / repeat for k, v in t.all_ms().items()},
                            "ours_over_torch": t.ratio("ours", "torch"),
                        }
                    )
    finally:
        torch.set_num_threads(saved)
    return out


def run(quick: bool = False) -> dict:
    cfg = QUICK if quick else FULL
    result = {
        "study": NAME,
        "quick": quick,
        "runs": cfg["runs"],
        "machine": machine(),
        "cores": len(_cores()),
        "points": [],
    }
    for dtype, leaves, size in cfg["points"]:
        point = _point(dtype, leaves, size, cfg["runs"], cfg["calls"])
        result["points"].append(point)
        for c in point["conditions"]:
            print(
                f"{dtype} {leaves} x {size}, {c['load']}, {c['threads']} thread(s): torch {c['ms']['torch']:.3f} ms, "
                f"ours {c['ms']['ours']:.3f} ms ({c['ours_over_torch']:.2f}x)",
                flush=True,
            )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small points, few rounds")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    write_result(run(quick=args.quick), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
