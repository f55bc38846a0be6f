"""Study 1, single process: how close each clip gets to the memory-bandwidth bound.

A global-norm clip must read every gradient element once (the norm) and then
read and write it once (the scale). The bound is that traffic over one flat
buffer of the same size, measured in the same run: ``flat.sum()`` plus an
in-place ``flat.mul_(c)`` (for the pure API, which writes new tensors,
``torch.mul(flat, c, out=other)`` into a preallocated buffer instead). The
in-place scale is compiled with the study's backend: torch's eager in-place
bf16 ``mul_`` on CPU runs well below the memory bandwidth (95 ms for 204 M
elements here, against 32 ms compiled and 38 ms for the out-of-place
``mul``), and a bound slower than the clips it bounds would bound nothing.

Variants, on GPT-2 leaf shapes (148 leaves, 203.6 M elements; ``--quick``:
2 blocks at dim 64, 28 leaves, and ``aot_eager`` instead of inductor, so that
the compiled variants are traced with ``fullgraph=True`` but not code-generated:
a check that runs in seconds, not a measurement), fp32 and bf16:

* ``torch_eager``: ``torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)``
* ``torch_compiled``: the same under ``torch.compile(fullgraph=True)``
* ``ours_eager_inplace`` / ``ours_compiled_inplace``: ``ppclip_func.clip_grad_norm_``
* ``ours_eager_pure`` / ``ours_compiled_pure``: ``ppclip_func.clip_grad_norm``
  (returns new tensors; the inputs are untouched)

The pure variants allocate as many bytes per call as the gradients hold, so
the C allocator decides much of their time (see bench/README.md, "The pure
API and the C allocator"). The full run measures them again under each
setting of :mod:`bench._allocator` (``default``, ``glibc-tuned``,
``jemalloc``), each in a process of its own started with that environment,
against the bound measured in that process: ``allocators`` in the JSON.
``--allocator NAME`` runs the whole study under one setting (``--pure-only``:
the bound and the pure variants only).

Each is reported in ms and as ``fraction_of_bound`` = time(bound) / time(variant)
(1.0 = as fast as the two flat passes), median of the per-round ratios.

    python -m bench.bandwidth_study [--quick] [--out DIR]
    python -m bench.bandwidth_study --allocator jemalloc [--pure-only]
    python -m bench.bandwidth_study --inplace-only   # the in-place bound and clips: bandwidth-inplace.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import traceback
from collections.abc import Callable

import torch

from bench import _allocator, _report
from bench._report import write_result
from bench._shapes import gpt_shapes, make_grads, make_params, numel
from bench._timing import Timings, interleaved, machine
from ppclip_func import clip_grad_norm, clip_grad_norm_

NAME = "bandwidth"
RESULTS = pathlib.Path(__file__).parent / "results"
MAX_NORM = 1.0
FULL = {"dim": 1024, "layers": 12, "vocab": 50257, "context": 1024}
QUICK = {"dim": 64, "layers": 2, "vocab": 2048, "context": 256}
INPLACE = ("torch_eager", "torch_compiled", "ours_eager_inplace", "ours_compiled_inplace")
PURE = ("ours_eager_pure", "ours_compiled_pure")


def _variants(
    dtype: torch.dtype,
    shapes: list[tuple[int, ...]],
    backend: str,
    device: torch.device,
    pure_only: bool,
    inplace_only: bool = False,
) -> tuple[dict[str, Callable[[], object]], dict]:
    grads = make_grads(shapes, dtype, device=device)
    params = make_params(grads)
    n = numel(shapes)
    flat = torch.empty(n, dtype=dtype, device=device).uniform_(-1.0, 1.0)
    other = torch.empty_like(flat)
    c = torch.tensor(0.999, dtype=torch.float32, device=device)

    def scale_(x: torch.Tensor, c: torch.Tensor) -> None:
        x.mul_(c)

    scale_compiled_ = torch.compile(scale_, fullgraph=True, backend=backend)
    scale_compiled_(flat, c)  # compile here, outside the timed rounds

    def bound_inplace() -> None:
        flat.sum()
        scale_compiled_(flat, c)

    def bound_pure() -> None:
        flat.sum()
        torch.mul(flat, c, out=other)

    def torch_clip(ps):
        return torch.nn.utils.clip_grad_norm_(ps, MAX_NORM, foreach=True)

    def ours_inplace(ps):
        return clip_grad_norm_(ps, None, MAX_NORM)

    def ours_pure(gs):
        return clip_grad_norm(gs, None, MAX_NORM)

    variants: dict[str, Callable[[], object]] = {
        "bound_inplace": bound_inplace,
        "bound_pure": bound_pure,
        "torch_eager": lambda: torch_clip(params),
        "ours_eager_inplace": lambda: ours_inplace(params),
        "ours_eager_pure": lambda: ours_pure(grads),
    }
    to_compile = [
        ("torch_compiled", torch_clip, params),
        ("ours_compiled_inplace", ours_inplace, params),
        ("ours_compiled_pure", ours_pure, grads),
    ]
    if pure_only:
        variants = {k: v for k, v in variants.items() if k == "bound_pure" or k in PURE}
        to_compile = [c for c in to_compile if c[0] in PURE]
    if inplace_only:
        variants = {k: v for k, v in variants.items() if k == "bound_inplace" or k in INPLACE}
        to_compile = [c for c in to_compile if c[0] in INPLACE]
    errors: dict[str, str] = {}
    for name, fn, arg in to_compile:
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        try:
            compiled(arg)  # compile here, outside the timed rounds
        except Exception as e:  # a failure to compile is a result: report it, measure the rest
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            traceback.print_exc()
            continue
        variants[name] = lambda compiled=compiled, arg=arg: compiled(arg)
    if device.type == "cuda":  # a call is timed until its kernels have finished
        variants = {k: lambda fn=fn: (fn(), torch.cuda.synchronize(device)) for k, fn in variants.items()}
    return variants, errors


def _summarize(t: Timings, n: int, dtype: torch.dtype) -> dict:
    nbytes = n * torch.finfo(dtype).bits // 8
    frac = {v: t.ratio("bound_inplace", v) for v in INPLACE if v in t.samples}
    frac.update({v: t.ratio("bound_pure", v) for v in PURE if v in t.samples})
    return {
        "bytes": nbytes,
        "ms": t.all_ms(),
        "fraction_of_bound": frac,
        # read (sum) + read and write (scale): three passes over the buffer
        "bound_GBps": {
            b: 3 * nbytes / (t.ms(b) * 1e-3) / 1e9 for b in ("bound_inplace", "bound_pure") if b in t.samples
        },
    }


def measure(
    named_shapes: list[tuple[str, tuple[int, ...]]],
    dtypes: tuple[torch.dtype, ...],
    *,
    device: str | torch.device = "cpu",
    runs: int,
    warmup: int,
    backend: str,
    pure_only: bool = False,
    inplace_only: bool = False,
) -> dict:
    """Times every variant on ``device`` for each dtype; the JSON body of a bandwidth study.

    ``pure_only``: the pure bound and the pure variants only; ``inplace_only``: the in-place ones.
    """
    device = torch.device(device)
    shapes = [s for _, s in named_shapes]
    n = numel(shapes)
    result: dict = {
        "machine": machine(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "runs": runs,
        "warmup": warmup,
        "model": {"leaves": len(shapes), "params": n},
        "compile_backend": backend,
        "allocator": _allocator.active(),
        "max_norm": MAX_NORM,
        "dtypes": {},
        "errors": {},
        # 1-minute load average before and after: the machine may be shared
        "loadavg": [os.getloadavg()[0]],
    }
    for dtype in dtypes:
        variants, errors = _variants(dtype, shapes, backend, device, pure_only, inplace_only)
        t = interleaved(variants, runs=runs, warmup=warmup)
        name = str(dtype).removeprefix("torch.")
        result["dtypes"][name] = _summarize(t, n, dtype)
        result["errors"].update({f"{name}/{k}": v for k, v in errors.items()})
        del variants
        torch._dynamo.reset()
    result["loadavg"].append(os.getloadavg()[0])
    return result


def run(quick: bool = False, out: pathlib.Path | None = None) -> dict:
    """Measures every variant in fp32 and bf16, and the pure ones under each allocator; writes ``<out>/bandwidth.json``.

    The pure variants under the allocator this process runs with are taken
    from the main measurement; under each other setting they are measured in
    a process started with that setting (``allocators`` in the result; a
    setting that cannot be used here, jemalloc not installed, is recorded as
    ``skipped``).
    """
    result = _measure_here(quick, pure_only=False)
    here = result["allocator"]
    allocators = {here: _pure_summary(result)}
    for name in _allocator.ALLOCATORS:
        if name == here:
            continue
        args = ["--allocator", name, "--pure-only", *(["--quick"] if quick else [])]
        try:
            allocators[name] = _pure_summary(_allocator.run_module(f"bench.{NAME}_study", args, name))
        except FileNotFoundError as e:
            allocators[name] = {"skipped": str(e)}
        except RuntimeError as e:
            result["errors"][f"allocator {name}"] = str(e)
    result["allocators"] = {name: allocators[name] for name in _allocator.ALLOCATORS if name in allocators}
    write_result(result, out)
    return result


def _measure_here(quick: bool, pure_only: bool, inplace_only: bool = False) -> dict:
    cfg = QUICK if quick else FULL
    runs, warmup = (5, 1) if quick else (9, 2)
    backend = "aot_eager" if quick else "inductor"
    dtypes = (torch.float32, torch.bfloat16)
    body = measure(
        gpt_shapes(**cfg), dtypes, runs=runs, warmup=warmup, backend=backend, pure_only=pure_only,
        inplace_only=inplace_only,
    )  # fmt: skip
    body["model"]["shapes"] = f"GPT-2 {cfg}"
    return {"study": NAME, "quick": quick, **body}


def _pure_summary(result: dict) -> dict:
    """The pure bound and variants of a result, with the load it was measured under."""
    keep = ("bound_pure", *PURE)
    dtypes = {
        d: {
            "ms": {k: v for k, v in r["ms"].items() if k in keep},
            "fraction_of_bound": {k: v for k, v in r["fraction_of_bound"].items() if k in keep},
        }
        for d, r in result["dtypes"].items()
    }
    return {"dtypes": dtypes, "loadavg": result["loadavg"], "errors": result["errors"]}


def plot(result: dict, path: pathlib.Path) -> None:
    """Bar chart: fraction of the bandwidth bound per variant, fp32 and bf16."""
    import matplotlib.pyplot as plt

    variants = [*INPLACE, *PURE]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.4
    for i, (dtype, d) in enumerate(result["dtypes"].items()):
        xs = [j + (i - 0.5) * width for j in range(len(variants))]
        ys = [d["fraction_of_bound"].get(v, 0.0) for v in variants]
        bars = ax.bar(xs, ys, width, label=dtype)
        for x, v, y in zip(xs, variants, ys):
            ms = d["ms"].get(v)
            ax.text(x, y + 0.01, f"{ms:.0f} ms" if ms is not None else "n/a", ha="center", fontsize=7, rotation=90)
        del bars
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.axhline(0.9, color="gray", lw=0.8, ls=":")
    ax.set_xticks(range(len(variants)), [v.replace("_", "\n", 1) for v in variants], fontsize=8)
    ax.set_ylabel("fraction of bandwidth bound (higher is better)")
    m = result["model"]
    ax.set_title(f"Clip of {m['params'] / 1e6:.1f} M params in {m['leaves']} leaves, 1 process")
    ax.legend()
    _report.save_figure(fig, path)


def print_result(result: dict) -> None:
    """Per dtype: the bound's bandwidth, then each variant's ms and fraction of the bound; then per allocator."""
    print(f"allocator: {result['allocator']}, 1-minute load {result['loadavg']}")
    for dtype, d in result["dtypes"].items():
        gbps = ", ".join(f"{b} {v:.1f} GB/s" for b, v in d["bound_GBps"].items())
        print(f"{dtype}: {gbps}")
        for v, ms in d["ms"].items():
            frac = d["fraction_of_bound"].get(v)
            print(f"  {v:<24} {ms:9.2f} ms" + (f"   {frac:5.2f} of bound" if frac is not None else ""))
    for name, a in result.get("allocators", {}).items():
        if "skipped" in a:
            print(f"pure under {name}: skipped ({a['skipped']})")
            continue
        cells = [
            f"{dtype} {v.removeprefix('ours_')} {a['dtypes'][dtype]['fraction_of_bound'][v]:.2f}"
            for dtype in a["dtypes"]
            for v in PURE
            if v in a["dtypes"][dtype]["fraction_of_bound"]
        ]
        print(f"pure under {name} (load {a['loadavg']}): " + ", ".join(cells))
    if result["errors"]:
        print("errors:", result["errors"])


def _write_named(result: dict, out: pathlib.Path | None, suffix: str) -> None:
    """Writes a partial run's result beside the full one: ``<out>/bandwidth-<suffix>.json``."""
    out = out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}-{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="results folder (default bench/results)")
    parser.add_argument(
        "--allocator",
        choices=_allocator.ALLOCATORS,
        help="run the study in a new process under this C allocator setting; writes bandwidth-<allocator>.json",
    )
    parser.add_argument("--pure-only", action="store_true", help="with --allocator: the pure variants only")
    parser.add_argument(
        "--inplace-only",
        action="store_true",
        help="the in-place bound and clips only, under this process's allocator; writes bandwidth-inplace.json",
    )
    parser.add_argument("--json", type=pathlib.Path, help=argparse.SUPPRESS)  # where a child writes its result
    args = parser.parse_args()
    if args.inplace_only:
        result = _measure_here(args.quick, pure_only=False, inplace_only=True)
        _write_named(result, args.out, "inplace")
        print_result(result)
    elif args.allocator is None:
        print_result(run(quick=args.quick, out=args.out))
    elif not _allocator.started_under(args.allocator):
        forwarded = ["--allocator", args.allocator, *(["--quick"] if args.quick else [])]
        forwarded += ["--pure-only"] if args.pure_only else []
        result = _allocator.run_module(f"bench.{NAME}_study", forwarded, args.allocator)
        _write_named(result, args.out, args.allocator)
        print_result(result)
    else:  # the child: started with the allocator's environment
        result = _measure_here(args.quick, args.pure_only)
        if args.json is None:
            sys.exit("--allocator: run without --json only by the parent process")
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
