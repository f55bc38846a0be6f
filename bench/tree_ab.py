"""Two checkouts of the package timed against each other in one run: eager, compiled, host cost, first compile.

For a change that moves code rather than adding a feature (the one path under
every form), what matters is that no call got slower. Two trees cannot be
imported in one process, so each measurement runs in a worker process of its
own, with ``PYTHONPATH`` at one tree, and the two trees' workers alternate
round by round (A B, then B A, ...): both numbers of a ratio come from the
same moment of the machine. A worker times one case: the median of its
repetitions after warm-up (eager and compiled steady state), or the wall time
of its first compiled call with inductor's caches off (first compile).

    python -m bench.tree_ab --other /path/to/other/checkout [--rounds 5] [--quick]

The ratio is this tree's time over the other's (lower is better); the result
goes to bench/results/tree_ab.json with the machine and both trees' commits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# name: (form, dtype, leaves, elements per leaf, compiled, repetitions)
CASES: dict[str, tuple[str, str, int, int, str, int]] = {
    "eager in place, 16 x 4096 fp32 (host)": ("clip_grad_norm_", "float32", 16, 4096, "eager", 400),
    "eager in place, 1000 x 4096 fp32": ("clip_grad_norm_", "float32", 1000, 4096, "eager", 30),
    "eager in place, 100 x 64K bf16": ("clip_grad_norm_", "bfloat16", 100, 65536, "eager", 20),
    "eager pure, 16 x 4096 fp32 (host)": ("clip_grad_norm", "float32", 16, 4096, "eager", 400),
    "eager adaptive in place, 16 x 4096 fp32 (host)": ("adaptive_clip_grad_norm_", "float32", 16, 4096, "eager", 400),
    "eager AdaGC in place, 16 x 4096 fp32 (host)": ("adagc_clip_grad_norm_", "float32", 16, 4096, "eager", 300),
    "eager by group in place, 16 x 4096 fp32 (host)": ("clip_grad_norm_by_group_", "float32", 16, 4096, "eager", 300),
    "compiled in place, 100 x 64K fp32": ("clip_grad_norm_", "float32", 100, 65536, "steady", 30),
    "first compile, in place, 145 x 4096 fp32": ("clip_grad_norm_", "float32", 145, 4096, "first", 1),
}
QUICK = ["eager in place, 16 x 4096 fp32 (host)", "eager adaptive in place, 16 x 4096 fp32 (host)"]


def _worker(name: str) -> float:
    """Seconds per call of case ``name`` with the ``ppclip_func`` on ``sys.path``."""
    import torch

    import ppclip_func as P

    form, dtype, leaves, size, mode, reps = CASES[name]
    g = torch.Generator().manual_seed(0)
    params = {
        f"layers.{i}.w": torch.zeros(size, dtype=getattr(torch, dtype), requires_grad=True) for i in range(leaves)
    }
    for p in params.values():
        p.grad = torch.randn(size, generator=g).to(p.dtype)
    state: list[Any] = [P.init_clip_state()]
    index = P.param_norm_index(params, None) if form.startswith("adagc") else None
    adagc_state: list[Any] = [P.init_adagc_state(index)] if index is not None else []
    groups = {"even": lambda n: int(n.split(".")[1]) % 2 == 0, "odd": "layers"}

    def call() -> Any:
        if form == "clip_grad_norm_":
            return P.clip_grad_norm_(params, None, 1.0)
        if form == "clip_grad_norm":
            return P.clip_grad_norm({n: p.grad for n, p in params.items()}, None, 1.0)[1]
        if form == "adaptive_clip_grad_norm_":
            stats = P.adaptive_clip_grad_norm_(params, None, state[0])
            state[0] = stats.state
            return stats.total_norm
        if form == "adagc_clip_grad_norm_":
            stats = P.adagc_clip_grad_norm_(params, None, adagc_state[0], index)
            adagc_state[0] = stats.state
            return stats.total_norm
        if form == "clip_grad_norm_by_group_":
            return P.clip_grad_norm_by_group_(params, None, groups, 1.0, group_max_norm={"odd": 0.5})[0]
        raise ValueError(form)

    fn = torch.compile(call, fullgraph=True) if mode in ("steady", "first") else call
    if mode == "first":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    for _ in range(max(3, reps // 10)):
        fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn()
        float(out)
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def _run_worker(tree: Path, name: str) -> float:
    # This file runs as a script (its folder first on sys.path), the package comes from ``tree``.
    env = {**os.environ, "PYTHONPATH": str(tree), "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--worker", name],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def _commit(tree: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree, capture_output=True, text=True
    )
    return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--other", type=Path, help="the checkout to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK}, 3 rounds")
    parser.add_argument("--only", nargs="+", default=None, help="cases whose names contain one of these")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tree_ab.json")
    args = parser.parse_args()
    if args.worker:
        print(_worker(args.worker))
        return
    if args.other is None:
        parser.error("--other is required")
    names = QUICK if args.quick else list(CASES)
    if args.only:
        names = [n for n in names if any(part in n for part in args.only)]
    rounds = 3 if args.quick else args.rounds
    this, other = ROOT, args.other.resolve()
    results = {}
    for name in names:
        n = 2 if CASES[name][4] == "first" else rounds
        ours: list[float] = []
        theirs: list[float] = []
        for r in range(n):
            order = [(this, ours), (other, theirs)] if r % 2 == 0 else [(other, theirs), (this, ours)]
            for tree, into in order:
                into.append(_run_worker(tree, name))
        ratio = statistics.median(a / b for a, b in zip(ours, theirs))
        results[name] = {"this_ms": 1e3 * statistics.median(ours), "other_ms": 1e3 * statistics.median(theirs)}
        results[name]["ratio"] = ratio
        print(
            f"{name}: this {results[name]['this_ms']:.3f} ms, other {results[name]['other_ms']:.3f} ms, ratio {ratio:.3f}",
            flush=True,
        )
    sys.path.insert(0, str(ROOT))
    from bench._timing import machine

    record = {"machine": machine(), "this": _commit(this), "other": _commit(other), "rounds": rounds, "cases": results}
    if not args.quick and not args.only:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
