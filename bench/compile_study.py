"""Compile study, single process: what ``torch.compile`` costs and buys for the clip.

Two measurements, reported apart (compile time is never mixed into steady state):

1. **Compile time** of ``torch.compile(fullgraph=True)`` (inductor, CPU) of
   ``ppclip_func.clip_grad_norm_`` on ``N`` small fp32 leaves with llama-like
   shapes, next to torch.compile of torch's own
   ``get_total_norm`` + ``clip_grads_with_norm_`` on the same grads. Compile
   time is the first call minus a steady call, with inductor's FX-graph and
   AOTAutograd caches off, after ``torch._dynamo.reset()``.
2. **Steady state** on large fp32 grads (GPT-2 leaf shapes): the compiled
   clip, in place and pure, against eager ``torch.nn.utils.clip_grad_norm_
   (foreach=True)`` and against the bandwidth bound measured in the same
   rounds: in place, ``flat.sum()`` + ``flat.mul_(c)`` on one flat buffer of
   the same size; pure, ``flat.sum()`` + ``torch.mul(flat, c, out=other)``.
   ``fraction_of_bound`` = time(bound) / time(variant), median of per-round
   ratios (``bench._timing.interleaved``).

``mesh=None`` throughout: one process, so no collective (the graph is the
same one plus one ``all_reduce`` on a mesh).

    python -m bench.compile_study            # ~1 min: compile at 145 leaves, steady state at 30 M elements
    python -m bench.compile_study --quick    # ~20 s smoke run: aot_eager, 145 leaves, 3.7 M elements
    python -m bench.compile_study --leaves 145 1000   # adds 1000 leaves: about 8 min more on 2 cores

Results go to ``bench/results/compile.json``; compile-time entries of earlier
runs for other leaf counts or backends are kept (each says when and under
which load it was measured).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import pathlib
import time
from collections.abc import Callable, Sequence

import torch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from bench._report import RESULTS, write_result
from bench._shapes import gpt_shapes, make_grads, make_params, numel
from bench._timing import Timings, cpu_seconds, interleaved, machine
from ppclip_func import clip_grad_norm, clip_grad_norm_

NAME = "compile"
STEADY_FULL = {"dim": 512, "layers": 8, "vocab": 8192, "context": 512}
STEADY_QUICK = {"dim": 256, "layers": 4, "vocab": 2048, "context": 256}
# One llama block (torchtitan names) at dim 64: attention, feed-forward, two norms.
LLAMA_BLOCK = [(64, 64), (64, 64), (64, 64), (64, 64), (176, 64), (64, 176), (176, 64), (64,), (64,)]


def llama_shapes(n_leaves: int) -> list[tuple[int, ...]]:
    """``n_leaves`` shapes: an embedding, whole llama blocks, then the final norm and output."""
    body = [LLAMA_BLOCK[i % len(LLAMA_BLOCK)] for i in range(max(n_leaves - 3, 0))]
    return [(512, 64), *body, (64,), (512, 64)][:n_leaves]


# --- what gets compiled -----------------------------------------------------------------------


def ours_inplace(params: list[torch.nn.Parameter], max_norm: torch.Tensor) -> torch.Tensor:
    return clip_grad_norm_(params, None, max_norm)


def ours_pure(grads: list[torch.Tensor], max_norm: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    return clip_grad_norm(grads, None, max_norm)


def torch_inplace(params: list[torch.nn.Parameter], max_norm: torch.Tensor) -> torch.Tensor:
    """torch's own split API: measure, then apply (what ``clip_grad_norm_`` composes)."""
    total = get_total_norm([p.grad for p in params], 2.0, False, True)
    clip_grads_with_norm_(params, max_norm, total, True)
    return total


COMPILED: dict[str, Callable] = {
    "ppclip clip_grad_norm_ (in place)": ours_inplace,
    "ppclip clip_grad_norm (pure)": ours_pure,
    "torch get_total_norm + clip_grads_with_norm_": torch_inplace,
}


# --- 1. compile time --------------------------------------------------------------------------


def compile_time(impl: str, n_leaves: int, backend: str) -> dict:
    """Seconds from the first call of a fresh ``torch.compile`` to its result, minus one steady call.

    Both wall time and CPU time (this process and the compiler processes it
    waited for) are kept: on a shared machine the CPU time is the steadier one.
    """
    grads = make_grads(llama_shapes(n_leaves), torch.float32)
    arg = grads if "pure" in impl else make_params(grads)
    max_norm = torch.tensor(1.0)
    torch._dynamo.reset()
    compiled = torch.compile(COMPILED[impl], backend=backend, fullgraph=True)
    load = os.getloadavg()[0]
    with no_compile_caches():
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        compiled(arg, max_norm)
        first, first_cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    steady = min(_seconds(lambda: compiled(arg, max_norm)) for _ in range(3))
    torch._dynamo.reset()
    return {
        "impl": impl,
        "leaves": n_leaves,
        "backend": backend,
        "compile_s": first - steady,
        "compile_cpu_s": first_cpu - steady,
        "steady_ms": 1e3 * steady,
        "load_avg_1min": load,
        "measured": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def warm_up_compiler(backend: str) -> None:
    """One untimed compile, so one-time start-up costs (imports, the C++ toolchain's first run) land nowhere."""
    torch._dynamo.reset()
    with no_compile_caches():
        torch.compile(lambda x: (x * 2).sum(), backend=backend, fullgraph=True)(torch.ones(8))
    torch._dynamo.reset()


def no_compile_caches() -> contextlib.ExitStack:
    """Inductor's on-disk caches off, and C++ compiled in this process's own children (so their CPU time counts)."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False, compile_threads=1))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


def _seconds(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --- 2. steady state --------------------------------------------------------------------------


def steady_state(cfg: dict, runs: int, warmup: int, backend: str = "inductor") -> dict:
    """Compiled clip (in place, pure) vs eager torch vs the bandwidth bounds, interleaved rounds."""
    shapes = [s for _, s in gpt_shapes(**cfg)]
    n = numel(shapes)
    # Each variant scales its own copy of the grads, so none sees another's clipped values.
    ours_params = make_params(make_grads(shapes, torch.float32, seed=1))
    torch_params = make_params(make_grads(shapes, torch.float32, seed=1))
    pure_grads = make_grads(shapes, torch.float32, seed=1)
    flat = torch.empty(n).uniform_(-1.0, 1.0)
    other = torch.empty_like(flat)
    c = torch.tensor(0.999)
    # The clip bites on every call (about 1% per call, so 100 calls keep values far from denormals).
    max_norm = 0.99 * float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in ours_params])))
    max_norm_t = torch.tensor(max_norm)

    inplace = torch.compile(ours_inplace, backend=backend, fullgraph=True)
    pure = torch.compile(ours_pure, backend=backend, fullgraph=True)

    def bound_inplace() -> None:
        flat.sum()
        flat.mul_(c)

    def bound_pure() -> None:
        flat.sum()
        torch.mul(flat, c, out=other)

    variants: dict[str, Callable[[], object]] = {
        "bound_inplace": bound_inplace,
        "bound_pure": bound_pure,
        "torch_eager_inplace": lambda: torch.nn.utils.clip_grad_norm_(torch_params, max_norm, foreach=True),
        "ours_compiled_inplace": lambda: inplace(ours_params, max_norm_t),
        "ours_compiled_pure": lambda: pure(pure_grads, max_norm_t),
    }
    result = {
        "model": f"GPT-2 shapes {cfg}",
        "backend": backend,
        "leaves": len(shapes),
        "elements": n,
        "bytes": 4 * n,
        "runs": runs,
        "warmup": warmup,
        "default_allocator": _summarize(interleaved(variants, runs=runs, warmup=warmup), 4 * n),
    }
    # The pure clip writes new tensors every call. glibc hands large freed blocks
    # back to the OS, so each call page-faults its outputs in afresh (costly in
    # a VM); measured again with freed memory kept, the difference is that cost.
    if _glibc_thresholds(mmap=32 << 20, trim=(1 << 31) - 1):
        try:
            result["freed_memory_kept"] = _summarize(interleaved(variants, runs=runs, warmup=warmup), 4 * n)
        finally:
            _glibc_thresholds(mmap=128 << 10, trim=128 << 10)  # glibc's defaults (now fixed, not dynamic)
    return result


def _glibc_thresholds(mmap: int, trim: int) -> bool:
    """Sets glibc malloc's mmap and trim thresholds (``mallopt``); False where that is not possible."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, mmap) and libc.mallopt(m_trim_threshold, trim))


def _summarize(t: Timings, nbytes: int) -> dict:
    return {
        "ms": t.all_ms(),
        "fraction_of_bound": {
            "ours_compiled_inplace": t.ratio("bound_inplace", "ours_compiled_inplace"),
            "ours_compiled_pure": t.ratio("bound_pure", "ours_compiled_pure"),
            "torch_eager_inplace": t.ratio("bound_inplace", "torch_eager_inplace"),
        },
        "speedup_vs_torch_eager": {
            "ours_compiled_inplace": t.ratio("torch_eager_inplace", "ours_compiled_inplace"),
            "ours_compiled_pure": t.ratio("torch_eager_inplace", "ours_compiled_pure"),
        },
        # read (sum) + read and write (scale): three passes over the buffer
        "bound_GBps": {b: 3 * nbytes / (t.ms(b) * 1e-3) / 1e9 for b in ("bound_inplace", "bound_pure")},
        "rounds_inplace_slower_than_torch": _rounds_slower(t, "ours_compiled_inplace", "torch_eager_inplace"),
        "load_avg_1min": os.getloadavg()[0],
    }


def _rounds_slower(t: Timings, a: str, b: str) -> int:
    return sum(x > y for x, y in zip(t.samples[a], t.samples[b]))


# --- driver -----------------------------------------------------------------------------------


def run(quick: bool = False, leaves: Sequence[int] | None = None, out: pathlib.Path | None = None) -> dict:
    """Runs both measurements; writes ``<out>/compile.json`` (merged with earlier entries) and returns it.

    Args:
        quick: ``aot_eager`` instead of inductor (trace-only compile time, no
            generated kernels) and a smaller steady-state model: a smoke run.
        leaves: Leaf counts for compile time (default: 145). The pure API's
            compile time is measured at the smallest count only.
        out: Results folder (default ``bench/results``).
    """
    leaves = sorted(leaves or [145])
    backend = "aot_eager" if quick else "inductor"
    compile_rows = []
    warm_up_compiler(backend)
    for n in leaves:
        for impl in COMPILED:
            if "pure" in impl and n != leaves[0]:
                continue
            row = compile_time(impl, n, backend)
            print(
                f"compile {impl:<46} {n:5d} leaves  {backend:<9} {row['compile_s']:7.1f} s wall "
                f"{row['compile_cpu_s']:7.1f} s CPU",
                flush=True,
            )
            compile_rows.append(row)
    cfg, runs, warmup = (STEADY_QUICK, 9, 1) if quick else (STEADY_FULL, 21, 2)
    steady = steady_state(cfg, runs, warmup, backend)
    torch._dynamo.reset()
    result = {
        "study": NAME,
        "machine": {**machine(), "cpus": os.cpu_count()},
        "compile_time": compile_rows,
        "steady_state": {f"{steady['elements']} {backend}": steady},
    }
    return _write(result, out)


def _write(result: dict, out: pathlib.Path | None) -> dict:
    """Merges ``result`` into the JSON file: new entries replace old ones with the same key."""
    path = (out or RESULTS) / f"{NAME}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    key = lambda r: (r["impl"], r["leaves"], r["backend"])  # noqa: E731
    fresh = {key(r) for r in result["compile_time"]}
    kept = [r for r in old.get("compile_time", []) if key(r) not in fresh]
    merged = {
        **result,
        "compile_time": sorted(kept + result["compile_time"], key=lambda r: (r["backend"], r["leaves"], r["impl"])),
        "steady_state": {**old.get("steady_state", {}), **result["steady_state"]},
    }
    write_result(merged, out)
    return merged


def report(result: dict) -> str:
    """A small text table of the results."""
    lines = [f"{'compile time':<48} {'leaves':>6}  {'backend':<9} {'wall s':>8} {'CPU s':>8}"]
    for r in result["compile_time"]:
        lines.append(
            f"  {r['impl']:<46} {r['leaves']:6d}  {r['backend']:<9} {r['compile_s']:8.1f} {r['compile_cpu_s']:8.1f}"
        )
    for steady in result["steady_state"].values():
        for allocator in ("default_allocator", "freed_memory_kept"):
            if allocator not in steady:
                continue
            s = steady[allocator]
            lines.append(
                f"steady state, {steady['elements'] / 1e6:.1f} M fp32 elements in {steady['leaves']} leaves, "
                f"{steady.get('backend', 'inductor')}, {allocator.replace('_', ' ')} (median ms)"
            )
            for v, ms in s["ms"].items():
                frac = s["fraction_of_bound"].get(v)
                speed = s["speedup_vs_torch_eager"].get(v)
                extra = f"  {frac:5.2f} of bound" if frac is not None else ""
                extra += f"  {speed:5.2f}x torch eager" if speed is not None else ""
                lines.append(f"  {v:<24} {ms:9.2f}{extra}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="trace-only compile time, small steady-state model")
    parser.add_argument("--leaves", type=int, nargs="+", help="leaf counts for compile time (default 145)")
    args = parser.parse_args()
    print(report(run(quick=args.quick, leaves=args.leaves)))


if __name__ == "__main__":
    main()
