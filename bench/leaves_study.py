"""Study 2, single process: how clip time grows with the number of gradient leaves.

Two series, 100 → 10 000 leaves (``--quick``: 10 and 100):

* ``fixed_total``: the same number of elements split into more, smaller leaves
  (the per-leaf overhead shows directly);
* ``fixed_leaf``: leaves of one size, so the total grows with the count.

Variants, all clipping in place with ``max_norm=1``:

* ``torch_eager`` / ``torch_compiled``: ``torch.nn.utils.clip_grad_norm_(foreach=True)``
  on plain tensors;
* ``ours_eager`` / ``ours_compiled``: ``ppclip_func.clip_grad_norm_`` on the same;
* ``torch_dtensor_eager``: the torchtitan-style path on DTensor grads
  (``Shard(0)`` on a one-rank mesh): ``get_total_norm`` over DTensors,
  ``full_tensor()``, ``clip_grads_with_norm_``; every foreach op goes through
  DTensor dispatch;
* ``ours_dtensor_eager``: ``ppclip_func.clip_grad_norm_`` on the same DTensors.

Compiled variants stop at ``compile_max_leaves`` = 1000 (compile time grows
with the leaf count: minutes at 1000 leaves on 2 cores; it is recorded per
point as ``compile_s``). ``--quick`` traces them with ``aot_eager`` instead of
inductor: a check that they compile with ``fullgraph=True``, not a measurement.

    python -m bench.leaves_study [--quick]
"""

from __future__ import annotations

import pathlib
import time
import traceback
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from bench import _report
from bench._dist import single_rank_group, torchtitan_clip
from bench._report import write_result
from bench._shapes import make_grads, make_params
from bench._timing import interleaved, machine
from ppclip_func import clip_grad_norm_

NAME = "leaves"
FULL = {
    "counts": [100, 300, 1000, 3000, 10000],
    "total": 16 * 2**20,
    "leaf": 4096,
    "compile_max_leaves": 1000,
    "compile_backend": "inductor",
}
# aot_eager: the compiled variants are traced (fullgraph) but not code-generated; a check, not a measurement.
QUICK = {"counts": [10, 100], "total": 2**18, "leaf": 1024, "compile_max_leaves": 100, "compile_backend": "aot_eager"}
VARIANTS = (
    "torch_eager",
    "ours_eager",
    "torch_compiled",
    "ours_compiled",
    "torch_dtensor_eager",
    "ours_dtensor_eager",
)


def dtensor_params(grads: list[torch.Tensor], mesh) -> list[torch.nn.Parameter]:
    """Parameters whose data and grad are ``Shard(0)`` DTensors on ``mesh``, the grads copies of ``grads``."""
    params = []
    for g in grads:
        p = torch.nn.Parameter(DTensor.from_local(torch.empty_like(g), mesh, [Shard(0)], run_check=False))
        p.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)], run_check=False)
        params.append(p)
    return params


def _point(n_leaves: int, leaf_size: int, mesh, backend: str | None, runs: int) -> dict:
    grads = make_grads([(leaf_size,)] * n_leaves, torch.float32)
    params = make_params(grads)
    dparams = dtensor_params(grads, mesh)

    def torch_clip(ps):
        return torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)

    def ours(ps):
        return clip_grad_norm_(ps, None, 1.0)

    variants: dict[str, Callable[[], object]] = {
        "torch_eager": lambda: torch_clip(params),
        "ours_eager": lambda: ours(params),
        "torch_dtensor_eager": lambda: torchtitan_clip(dparams, 1.0),
        "ours_dtensor_eager": lambda: clip_grad_norm_(dparams, mesh, 1.0),
    }
    compile_s: dict[str, float] = {}
    errors: dict[str, str] = {}
    if backend is not None:
        for name, fn in (("torch_compiled", torch_clip), ("ours_compiled", ours)):
            c = torch.compile(fn, fullgraph=True, backend=backend)
            t0 = time.perf_counter()
            try:
                c(params)
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                traceback.print_exc()
                continue
            compile_s[name] = time.perf_counter() - t0
            variants[name] = lambda c=c: c(params)
    t = interleaved(variants, runs=runs, warmup=1)
    out = {
        "leaves": n_leaves,
        "leaf_size": leaf_size,
        "elements": n_leaves * leaf_size,
        "ms": t.all_ms(),
        # The first call pays one-time costs (DTensor sharding propagation); compiled: after compiling.
        "first_call_ms": {k: 1e3 * v for k, v in t.first.items()},
    }
    out["ratio_torch_over_ours"] = {
        "eager": t.ratio("torch_eager", "ours_eager"),
        "dtensor_eager": t.ratio("torch_dtensor_eager", "ours_dtensor_eager"),
    }
    if "torch_compiled" in t.samples and "ours_compiled" in t.samples:
        out["ratio_torch_over_ours"]["compiled"] = t.ratio("torch_compiled", "ours_compiled")
    if compile_s:
        out["compile_s"] = compile_s
    if errors:
        out["errors"] = errors
    torch._dynamo.reset()
    return out


def run(quick: bool = False, out: pathlib.Path | None = None) -> dict:
    """Measures both series; writes ``<out>/leaves.json`` and returns it."""
    cfg = QUICK if quick else FULL
    runs = 5 if quick else 7
    result: dict = {
        "study": NAME,
        "quick": quick,
        "machine": machine(),
        "runs": runs,
        "warmup": 1,
        "config": cfg,
        "series": {"fixed_total": [], "fixed_leaf": []},
    }
    with single_rank_group():
        mesh = init_device_mesh("cpu", (1,))
        # Pay the backend's one-time start-up before any point, so no compile_s includes it.
        torch.compile(lambda x: x + 1, backend=cfg["compile_backend"])(torch.ones(1))
        for n in cfg["counts"]:
            backend = cfg["compile_backend"] if n <= cfg["compile_max_leaves"] else None
            result["series"]["fixed_total"].append(_point(n, cfg["total"] // n, mesh, backend, runs))
            result["series"]["fixed_leaf"].append(_point(n, cfg["leaf"], mesh, backend, runs))
    write_result(result, out)
    return result


def plot(result: dict, path: pathlib.Path) -> None:
    """Time per clip against the leaf count, log-log, one panel per series."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    cfg = result["config"]
    titles = {
        "fixed_total": f"fixed total ({cfg['total'] / 2**20:g} Mi elements)",
        "fixed_leaf": f"fixed leaf size ({cfg['leaf']} elements)",
    }
    for ax, (series, points) in zip(axes, result["series"].items()):
        for v in VARIANTS:
            xs = [p["leaves"] for p in points if v in p["ms"]]
            ys = [p["ms"][v] for p in points if v in p["ms"]]
            if xs:
                ax.plot(xs, ys, marker="o", ls="--" if "torch" in v else "-", label=v)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("gradient leaves")
        ax.set_ylabel("ms per clip (lower is better)")
        ax.set_title(titles[series])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    _report.save_figure(fig, path)


def main() -> None:
    r = _report.quick_cli(__doc__, run)
    for series, points in r["series"].items():
        print(series)
        for p in points:
            cells = "  ".join(f"{v} {p['ms'][v]:.2f}" for v in VARIANTS if v in p["ms"])
            print(f"  {p['leaves']:6d} leaves: {cells} ms")


if __name__ == "__main__":
    main()
