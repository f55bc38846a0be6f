"""What overflow safety costs: float32 vs float64 local accumulation of fp32 grads.

``overflow_safe=True`` makes every leaf accumulate in float64 so that finite
fp32 grads whose sum of squares passes 3.4e38 keep a finite norm. It costs no
extra collective (the statistics are float64 either way); the cost is the
local reduction. Measured here, eager and compiled, on GPT-like fp32 leaf
shapes, A/B interleaved, median of the runs after warm-up, as ratios within
the same run.

    python -m bench.overflow_study [--quick]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from bench._report import RESULTS, write_result
from ppclip_func import global_grad_norm


def _grads(total: int) -> list[torch.Tensor]:
    d = 1024
    per_block = 12 * d * d  # attention + MLP weights of one block
    blocks = max(1, total // per_block)
    g = torch.Generator().manual_seed(0)
    leaves = []
    for _ in range(blocks):
        leaves += [torch.randn(d, d, generator=g) for _ in range(4)]
        leaves += [torch.randn(4 * d, d, generator=g), torch.randn(d, 4 * d, generator=g)]
        leaves += [torch.randn(d, generator=g), torch.randn(d, generator=g)]
    return leaves


def _median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run(quick: bool = False) -> dict:
    """Runs the study and returns (and writes) its results."""
    leaves = _grads(12 * 1024 * 1024 * (1 if quick else 8))
    runs = 5 if quick else 9
    variants = {
        "eager_fp32_acc": lambda: global_grad_norm(leaves, None),
        "eager_overflow_safe": lambda: global_grad_norm(leaves, None, overflow_safe=True),
    }
    compiled_fp32 = torch.compile(lambda g: global_grad_norm(g, None), fullgraph=True)
    compiled_safe = torch.compile(lambda g: global_grad_norm(g, None, overflow_safe=True), fullgraph=True)
    variants["compiled_fp32_acc"] = lambda: compiled_fp32(leaves)
    variants["compiled_overflow_safe"] = lambda: compiled_safe(leaves)
    for fn in variants.values():  # warm-up (and compile)
        fn()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(runs):  # interleaved: every round measures every variant once
        for name, fn in variants.items():
            samples[name].append(_median_ms(fn, 1))
    ms = {k: statistics.median(v) for k, v in samples.items()}
    result = {
        "study": "overflow",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "params": sum(t.numel() for t in leaves),
        "leaves": len(leaves),
        "runs": runs,
        "ms": ms,
        "overflow_safe_cost_eager": ms["eager_overflow_safe"] / ms["eager_fp32_acc"],
        "overflow_safe_cost_compiled": ms["compiled_overflow_safe"] / ms["compiled_fp32_acc"],
    }
    write_result(result, RESULTS)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~12M params, 5 runs")
    r = run(quick=parser.parse_args().quick)
    print(f"{r['params'] / 1e6:.0f}M fp32 params in {r['leaves']} leaves, median of {r['runs']} interleaved runs")
    for k, v in r["ms"].items():
        print(f"  {k:<24} {v:8.1f} ms")
    print(
        f"  overflow_safe costs x{r['overflow_safe_cost_eager']:.2f} eager, x{r['overflow_safe_cost_compiled']:.2f} compiled"
    )


if __name__ == "__main__":
    main()
