"""Study 1, single process: how close each clip gets to the memory-bandwidth bound.

A global-norm clip must read every gradient element once (the norm) and then
read and write it once (the scale). The bound is that traffic over one flat
buffer of the same size, measured in the same run: ``flat.sum()`` plus an
in-place ``flat.mul_(c)`` (for the pure API, which writes new tensors,
``torch.mul(flat, c, out=other)`` into a preallocated buffer instead).

Variants, on GPT-2 leaf shapes (148 leaves, 203.6 M elements; ``--quick``:
2 blocks at dim 64, 28 leaves, and ``aot_eager`` instead of inductor, so that
the compiled variants are traced with ``fullgraph=True`` but not code-generated:
a check that runs in seconds, not a measurement), fp32 and bf16:

* ``torch_eager``: ``torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)``
* ``torch_compiled``: the same under ``torch.compile(fullgraph=True)``
* ``ours_eager_inplace`` / ``ours_compiled_inplace``: ``ppclip_func.clip_grad_norm_``
* ``ours_eager_pure`` / ``ours_compiled_pure``: ``ppclip_func.clip_grad_norm``
  (returns new tensors; the inputs are untouched)

Each is reported in ms and as ``fraction_of_bound`` = time(bound) / time(variant)
(1.0 = as fast as the two flat passes), median of the per-round ratios.

    python -m bench.bandwidth_study [--quick]
"""

from __future__ import annotations

import argparse
import pathlib
import traceback
from collections.abc import Callable

import torch

from bench._report import write_result
from bench._shapes import gpt_shapes, make_grads, make_params, numel
from bench._timing import Timings, interleaved, machine
from ppclip_func import clip_grad_norm, clip_grad_norm_

NAME = "bandwidth"
MAX_NORM = 1.0
FULL = {"dim": 1024, "layers": 12, "vocab": 50257, "context": 1024}
QUICK = {"dim": 64, "layers": 2, "vocab": 2048, "context": 256}
INPLACE = ("torch_eager", "torch_compiled", "ours_eager_inplace", "ours_compiled_inplace")
PURE = ("ours_eager_pure", "ours_compiled_pure")


def _variants(
    dtype: torch.dtype, shapes: list[tuple[int, ...]], backend: str, device: torch.device
) -> tuple[dict[str, Callable[[], object]], dict]:
    grads = make_grads(shapes, dtype, device=device)
    params = make_params(grads)
    n = numel(shapes)
    flat = torch.empty(n, dtype=dtype, device=device).uniform_(-1.0, 1.0)
    other = torch.empty_like(flat)
    c = torch.tensor(0.999, dtype=torch.float32, device=device)

    def bound_inplace() -> None:
        flat.sum()
        flat.mul_(c)

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
    errors: dict[str, str] = {}
    for name, fn, arg in (
        ("torch_compiled", torch_clip, params),
        ("ours_compiled_inplace", ours_inplace, params),
        ("ours_compiled_pure", ours_pure, grads),
    ):
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
        "bound_GBps": {b: 3 * nbytes / (t.ms(b) * 1e-3) / 1e9 for b in ("bound_inplace", "bound_pure")},
    }


def measure(
    named_shapes: list[tuple[str, tuple[int, ...]]],
    dtypes: tuple[torch.dtype, ...],
    *,
    device: str | torch.device = "cpu",
    runs: int,
    warmup: int,
    backend: str,
) -> dict:
    """Times every variant on ``device`` for each dtype; the JSON body of a bandwidth study."""
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
        "max_norm": MAX_NORM,
        "dtypes": {},
        "errors": {},
    }
    for dtype in dtypes:
        variants, errors = _variants(dtype, shapes, backend, device)
        t = interleaved(variants, runs=runs, warmup=warmup)
        name = str(dtype).removeprefix("torch.")
        result["dtypes"][name] = _summarize(t, n, dtype)
        result["errors"].update({f"{name}/{k}": v for k, v in errors.items()})
        del variants
        torch._dynamo.reset()
    return result


def run(quick: bool = False, out: pathlib.Path | None = None) -> dict:
    """Measures every variant in fp32 and bf16; writes ``<out>/bandwidth.json`` and returns it."""
    cfg = QUICK if quick else FULL
    runs, warmup = (5, 1) if quick else (9, 2)
    backend = "aot_eager" if quick else "inductor"
    body = measure(gpt_shapes(**cfg), (torch.float32, torch.bfloat16), runs=runs, warmup=warmup, backend=backend)
    body["model"]["shapes"] = f"GPT-2 {cfg}"
    result = {"study": NAME, "quick": quick, **body}
    write_result(result, out)
    return result


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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_result(result: dict) -> None:
    """Per dtype: the bound's bandwidth, then each variant's ms and fraction of the bound."""
    for dtype, d in result["dtypes"].items():
        print(f"{dtype}: bound {d['bound_GBps']['bound_inplace']:.1f} GB/s")
        for v, ms in d["ms"].items():
            frac = d["fraction_of_bound"].get(v)
            print(f"  {v:<24} {ms:9.2f} ms" + (f"   {frac:5.2f} of bound" if frac is not None else ""))
    if result["errors"]:
        print("errors:", result["errors"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print_result(run(quick=parser.parse_args().quick))


if __name__ == "__main__":
    main()
