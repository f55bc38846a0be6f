"""Study 9, one process: the clip where the step runs, compiled and eager, over leaf counts and leaf sizes.

Every point is a gradient list of ``leaves`` leaves of ``leaf_size``
elements, measured in one interleaved run (``bench/_timing.py``):

* ``torch_eager`` / ``torch_compiled``: ``torch.nn.utils.clip_grad_norm_
  (foreach=True)``, in place; compiled with inductor, ``fullgraph=True``;
* ``ours_eager`` / ``ours_compiled``: ``ppclip_func.clip_grad_norm_`` on
  the same grads;
* with ``--step`` points: the whole optimizer step compiled into one graph,
  ``torch_step`` (torch's clip, then a functional out-of-place AdamW) against
  ``ours_step`` (our clip, the same AdamW, then ``select_update`` on a skip
  decision taken from the norm).

Two series, fp32 and bf16: ``fixed_total`` spreads 16 M elements over 10 to
1000 leaves (the FSDP shard band: 300 leaves of 56 K, 1000 of 17 K), and
``fixed_leaf`` takes 128 leaves of 4 K, 64 K and 1 M elements. ``dtensor`` repeats
the 300-leaf point with ``Shard(0)`` DTensor grads on a one-rank mesh (compiled only:
torch's eager DTensor path is study 2's). Each point records the time of the
first compiled call (inductor's caches off and C++ compiled in this
process's children: a cold compile, its CPU time counted), and every
variant's norm against a float64 reference. Compile time is reported as wall
time and as CPU time (this process and the compile workers it waited for),
the steadier of the two on a shared machine.

Host work on an accelerator: ``host_ops`` counts the ops one eager clip
dispatches with the accelerator branch (``BLOCKWISE_FOREACH``) forced onto
this CPU, at 1000 and 10 000 leaves.

    python -m bench.sweep_study            # ~30 min on 2 cores (most of it inductor compiling)
    python -m bench.sweep_study --quick    # smoke run: aot_eager, small points
    python -m bench.sweep_study --dtypes float32 --series fixed_total fixed_leaf   # part of the sweep
    python -m bench.sweep_study --device cuda   # the same sweep on a GPU (bench/gpu_study.py runs it)
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import time
import traceback
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import ppclip_func._core.statistics as local
from bench._dist import single_rank_group
from bench._report import RESULTS, save_figure, write_result
from bench._shapes import make_grads, make_params
from bench._timing import cpu_seconds, interleaved, machine
from bench.compile_study import no_compile_caches
from bench.leaves_study import dtensor_params
from ppclip_func import clip_grad_norm_, select_update
from tests._collectives import OpCounter
from tests._reference import reference_norm

NAME = "sweep"
TOTAL = 16 * 2**20
FULL = {
    "fixed_total": [10, 100, 300, 1000],
    "fixed_leaf": [4096, 65536, 1 << 20],
    "fixed_leaf_count": 128,
    "dtensor": [(300, TOTAL // 300)],
    "step": [(300, TOTAL // 300)],
    "dtypes": ["float32", "bfloat16"],
    "backend": "inductor",
    "runs": 7,
}
QUICK = {
    "fixed_total": [10, 100],
    "fixed_leaf": [4096],
    "fixed_leaf_count": 16,
    "dtensor": [(16, 4096)],
    "step": [(16, 4096)],
    "dtypes": ["float32", "bfloat16"],
    "backend": "aot_eager",
    "runs": 5,
}
QUICK_TOTAL = 2**18
SERIES = ("fixed_total", "fixed_leaf", "step", "dtensor")


def torch_clip(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)


def ours_clip(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return clip_grad_norm_(params, None, 1.0)


def _adamw(params: list[torch.Tensor], grads: list[torch.Tensor], m: list[torch.Tensor], v: list[torch.Tensor]):
    """One AdamW step out of place (step 1, lr 1e-3, betas 0.9/0.95, weight decay 0.1): new (params, m, v)."""
    new_m = torch._foreach_lerp(m, grads, 0.1)
    new_v = torch._foreach_mul(v, 0.95)
    torch._foreach_addcmul_(new_v, grads, grads, 0.05)
    denom = torch._foreach_add(torch._foreach_sqrt(torch._foreach_div(new_v, 0.05)), 1e-8)
    decayed = torch._foreach_mul(params, 1.0 - 1e-4)
    return torch._foreach_addcdiv(decayed, new_m, denom, -1e-3 / 0.1), new_m, new_v


def torch_step(params, m, v):
    total = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    return _adamw([p.detach() for p in params], [p.grad for p in params], m, v), total


def ours_step(params, m, v):
    total = clip_grad_norm_(params, None, 1.0)
    old = ([p.detach() for p in params], m, v)
    new = _adamw(old[0], [p.grad for p in params], m, v)
    return select_update(~torch.isfinite(total), new, old), total


def _copy(grads: list[torch.Tensor], dtensor_mesh=None) -> list[torch.nn.Parameter]:
    """Parameters carrying fresh copies of ``grads`` (each variant clips its own)."""
    if dtensor_mesh is None:
        return make_params([g.clone() for g in grads])
    return dtensor_params(grads, dtensor_mesh)


def _error(norm: torch.Tensor, ref: float) -> float:
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return abs(float(norm) / ref - 1.0)


def point(
    leaves: int, leaf_size: int, dtype: torch.dtype, cfg: dict, device: str, *, mesh=None, step: bool = False
) -> dict:
    """One point: eager and compiled clips (or whole steps), torch's and ours, interleaved."""
    grads = make_grads([(leaf_size,)] * leaves, dtype, device=device)
    ref = reference_norm(grads, 2.0)
    variants: dict[str, Callable[[], object]] = {}
    errors: dict[str, float] = {}
    compile_s: dict[str, float] = {}
    compile_cpu_s: dict[str, float] = {}
    failed: dict[str, str] = {}
    if step:
        impls = {"torch_step": torch_step, "ours_step": ours_step}
    else:
        impls = {} if cfg.get("eager_only") else {"torch_compiled": torch_clip, "ours_compiled": ours_clip}
        if mesh is None:
            for name, fn in (("torch_eager", torch_clip), ("ours_eager", ours_clip)):
                params = _copy(grads)
                errors[name] = _error(fn(params), ref)
                variants[name] = lambda fn=fn, params=params: fn(params)
    for name, fn in impls.items():
        params = _copy(grads, mesh)
        args = (params,)
        if step:
            args = (params, [torch.zeros_like(g) for g in grads], [torch.zeros_like(g) for g in grads])
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend=cfg["backend"])
        try:
            with no_compile_caches():
                t0, cpu0 = time.perf_counter(), cpu_seconds()
                out = compiled(*args)
                _sync(device)
                compile_s[name] = time.perf_counter() - t0
                compile_cpu_s[name] = cpu_seconds() - cpu0
        except Exception as e:  # recorded, not hidden: a variant that does not compile has no time
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            traceback.print_exc()
            continue
        errors[name] = _error(out[1] if step else out, ref)
        # Later calls see grads already clipped: norms of 1, the same work.
        variants[name] = lambda compiled=compiled, args=args: compiled(*args)
    t = interleaved({k: _synced(f, device) for k, f in variants.items()}, runs=cfg["runs"], warmup=1)
    torch._dynamo.reset()
    ratios = {}
    for ours, theirs in (
        ("ours_eager", "torch_eager"),
        ("ours_compiled", "torch_compiled"),
        ("ours_step", "torch_step"),
    ):
        if ours in t.samples and theirs in t.samples:
            ratios[ours.replace("ours_", "")] = t.ratio(ours, theirs)
    out = {
        "leaves": leaves,
        "leaf_size": leaf_size,
        "dtype": str(dtype).replace("torch.", ""),
        "ms": t.all_ms(),
        "ratio_ours_over_torch": ratios,
        "compile_s": compile_s,
        "compile_cpu_s": compile_cpu_s,
        "rel_error": errors,
    }
    if failed:
        out["failed"] = failed
    return out


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _synced(fn: Callable[[], object], device: str) -> Callable[[], object]:
    def call() -> object:
        r = fn()
        _sync(device)
        return r

    return call


def host_ops(counts: tuple[int, ...] = (1000, 10_000)) -> dict[str, int]:
    """Ops one eager clip dispatches on the accelerator branch (forced onto the CPU), by leaf count."""
    before = local.BLOCKWISE_FOREACH
    local.BLOCKWISE_FOREACH = before | {"cpu"}
    try:
        out = {}
        for n in counts:
            params = make_params(make_grads([(64,)] * n, torch.float32))
            with OpCounter() as ours:
                ours_clip(params)
            with OpCounter() as theirs:
                torch_clip(make_params(make_grads([(64,)] * n, torch.float32)))
            out[str(n)] = {"ours": ours.n, "torch": theirs.n}
        return out
    finally:
        local.BLOCKWISE_FOREACH = before


def run(
    quick: bool = False,
    out: pathlib.Path | None = None,
    device: str = "cpu",
    dtypes: list[str] | None = None,
    series_names: list[str] | None = None,
    eager_only: bool = False,
) -> dict:
    """Measures the sweep; writes ``<out>/sweep.json`` (``sweep_cuda.json`` on a GPU) and returns it.

    ``dtypes``: the dtypes to run (default both; the DTensor point is float32's); ``series_names``: the
    series (default all of ``SERIES``); ``eager_only``: the eager clips alone, no compiled variant
    (a change to the eager path measured without a quarter of an hour of compiling).
    """
    cfg = QUICK if quick else FULL
    if dtypes is not None:
        cfg = {**cfg, "dtypes": dtypes}
    if series_names is not None:
        cfg = {**cfg, **{name: [] for name in SERIES if name not in series_names}}
    if eager_only:
        cfg = {**cfg, "eager_only": True, "step": [], "dtensor": []}
    total = QUICK_TOTAL if quick else TOTAL
    # On an accelerator the result is a study of its own (sweep_cuda.json), beside the CPU's.
    name = NAME if device == "cpu" else f"{NAME}_{torch.device(device).type}"
    result: dict = {"study": name, "quick": quick, "device": device, "machine": machine(), "runs": cfg["runs"]}
    result["config"] = cfg
    series: dict[str, list[dict]] = {"fixed_total": [], "fixed_leaf": [], "dtensor": [], "step": []}
    torch.compile(lambda x: x + 1, backend=cfg["backend"])(torch.ones(1))  # the backend's one-time start-up
    for name in cfg["dtypes"]:
        dtype = getattr(torch, name)
        for n in cfg["fixed_total"]:
            series["fixed_total"].append(point(n, total // n, dtype, cfg, device))
            print(series["fixed_total"][-1], flush=True)
        for size in cfg["fixed_leaf"]:
            series["fixed_leaf"].append(point(cfg["fixed_leaf_count"], size, dtype, cfg, device))
            print(series["fixed_leaf"][-1], flush=True)
        for n, size in cfg["step"]:
            series["step"].append(point(n, size, dtype, cfg, device, step=True))
            print(series["step"][-1], flush=True)
    if device == "cpu" and "float32" in cfg["dtypes"]:
        with single_rank_group():
            mesh = init_device_mesh("cpu", (1,))
            for n, size in cfg["dtensor"]:
                series["dtensor"].append(point(n, size, torch.float32, cfg, device, mesh=mesh))
                print(series["dtensor"][-1], flush=True)
        result["host_ops"] = host_ops((100, 1000) if quick else (1000, 10_000))
    result["series"] = series
    write_result(result, out)
    return result


def plot(result: dict, path: pathlib.Path) -> None:
    """Ours over torch's time at each point, eager and compiled, one panel per series; 1.0 is parity."""
    import matplotlib.pyplot as plt

    panels = [("fixed_total", "leaves", "16 M elements over N leaves"), ("fixed_leaf", "leaf_size", "leaf size")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (series, key, title) in zip(axes, panels):
        for dtype in result["config"]["dtypes"]:
            pts = [p for p in result["series"][series] if p["dtype"] == dtype]
            for mode, style in (("compiled", "o-"), ("eager", "s--")):
                xs = [p[key] for p in pts if mode in p["ratio_ours_over_torch"]]
                ys = [p["ratio_ours_over_torch"][mode] for p in pts if mode in p["ratio_ours_over_torch"]]
                ax.plot(xs, ys, style, label=f"{dtype} {mode}")
        ax.axhline(1.0, color="grey", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel(key.replace("_", " "))
        ax.set_ylabel("time, ours / torch's")
        ax.set_title(title)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small points, aot_eager: a smoke test")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--dtypes", nargs="+", choices=FULL["dtypes"], help="the dtypes to run (default: both)")
    parser.add_argument("--series", nargs="+", choices=SERIES, help="the series to run (default: all)")
    parser.add_argument("--eager-only", action="store_true", help="the eager clips alone (no step, no DTensor)")
    args = parser.parse_args()
    result = run(
        quick=args.quick,
        out=args.out,
        device=args.device,
        dtypes=args.dtypes,
        series_names=args.series,
        eager_only=args.eager_only,
    )
    if importlib.util.find_spec("matplotlib") is None:  # a bench extra: the test venv measures without it
        print("no plot: matplotlib is not installed (pip install -e '.[bench]')")
    else:
        plot(result, args.out / f"{result['study']}.png")


if __name__ == "__main__":
    main()
