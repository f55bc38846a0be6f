"""Timing: A/B interleaved rounds after warm-up, medians, and ratios taken within a round.

Every round runs every variant once, in an order rotated by one each round
(or shuffled), so slow drift of the machine (other processes, frequency, page
cache) lands on all variants alike. A ratio between two variants is the median over
rounds of their per-round ratio: both numbers of a pair come from the same
moment of the same run.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Mapping

import torch

__all__ = ["MIN_RUNS", "Timings", "cpu_seconds", "interleaved", "machine"]

MIN_RUNS = 5


@dataclasses.dataclass
class Timings:
    """Seconds per call of each variant, one sample per round, and of its first (warm-up) call."""

    samples: dict[str, list[float]]
    first: dict[str, float] = dataclasses.field(default_factory=dict)

    def ms(self, name: str) -> float:
        """Median milliseconds per call."""
        return 1e3 * statistics.median(self.samples[name])

    def ratio(self, num: str, den: str) -> float:
        """Median over rounds of ``time(num) / time(den)``."""
        return statistics.median(a / b for a, b in zip(self.samples[num], self.samples[den]))

    def all_ms(self) -> dict[str, float]:
        return {name: self.ms(name) for name in self.samples}


def interleaved(
    variants: Mapping[str, Callable[[], object]],
    *,
    runs: int,
    warmup: int = 1,
    barrier: Callable[[], None] | None = None,
    shuffle: bool = False,
) -> Timings:
    """Times each variant ``runs`` times, interleaved, after ``warmup`` untimed rounds.

    Args:
        variants: Name to a callable that runs one complete call (it must
            finish its work before returning: read the result if it is lazy).
        runs: Timed rounds (at least :data:`MIN_RUNS`).
        warmup: Untimed rounds first (compilation, allocator, caches).
        barrier: Called before each timed call (e.g. ``dist.barrier``) so that
            distributed ranks start each call together.
        shuffle: A random order each round (the same sequence on every rank:
            a fixed seed) instead of the rotation. With three or more
            variants a rotation gives each one the same predecessor almost
            every round, and what a call leaves behind (caches, a peer's
            timing) then biases the one after it.
    """
    if runs < MIN_RUNS:
        raise ValueError(f"runs must be >= {MIN_RUNS}, got {runs}")
    names = list(variants)
    first: dict[str, float] = {}
    for _ in range(warmup):
        for name in names:
            t0 = time.perf_counter()
            variants[name]()
            first.setdefault(name, time.perf_counter() - t0)
    samples: dict[str, list[float]] = {name: [] for name in names}
    rng = random.Random(0)
    for r in range(runs):
        order = rng.sample(names, len(names)) if shuffle else names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            variants[name]()
            samples[name].append(time.perf_counter() - t0)
    return Timings(samples, first)


def cpu_seconds() -> float:
    """CPU time of this process and of the children it waited for (inductor's compile workers): steadier
    than wall time on a shared machine."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def machine() -> dict[str, object]:
    """What the numbers were measured on."""
    return {
        "platform": platform.platform(),
        "processor": platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
