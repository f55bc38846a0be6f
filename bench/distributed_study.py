"""Study 3, real gloo ranks: ours against the torchtitan-style clip, per clip and per collective.

Each world size runs the demo's transformer split into 2 pipeline stages,
tensor-parallelized (``parallelize_module``) and sharded with FSDP2
(``fully_shard``) as in the demo, with random DTensor gradients of the real
layouts (``_StridedShard``/``Shard`` over ``dp`` × ``Shard`` or ``Replicate``
over ``tp``):

* 4 ranks: ``(pp, dp, tp) = (2, 2, 1)`` (FSDP × PP, the torchtitan#596 case);
* 8 ranks: ``(2, 2, 2)``.

Variants, each clipping in place with ``max_norm=1``:

* ``ours_eager`` / ``ours_compiled``: ``ppclip_func.clip_grad_norm_(params, mesh, 1.0)``
* ``baseline_eager`` / ``baseline_compiled``: ``bench._dist.torchtitan_clip``
  (``get_total_norm`` over DTensors, ``full_tensor()``, an all-reduce over the
  PP group, ``clip_grads_with_norm_``).

Time per clip is the slowest rank's time of each round (all ranks start a
round together after a barrier), median over interleaved rounds after
warm-up. Collectives per clip are counted on one call of each variant, from
the profiler's communication-backend events (``gloo:all_reduce``, ...), which
also sees the collectives of a compiled graph. Both norms are checked against
each other before timing. The baseline is compiled without ``fullgraph``
(its graph breaks are counted); ours with ``fullgraph=True``.

    python -m bench.distributed_study [--quick]    # --quick: 4 ranks, small model, aot_eager
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from bench._dist import count_collectives, spawn, torchtitan_clip, torchtitan_norm
from bench._timing import Timings, interleaved, machine

NAME = "distributed"
RESULTS = pathlib.Path(__file__).parent / "results"
MESHES = {4: (2, 2, 1), 8: (2, 2, 2)}
FULL = {"worlds": [4, 8], "dim": 256, "layers": 16, "vocab": 8192, "backend": "inductor", "runs": 9, "timeout": 1800}
# aot_eager: the compiled variants are traced but not code-generated; a check, not a measurement.
QUICK = {"worlds": [4], "dim": 64, "layers": 4, "vocab": 512, "backend": "aot_eager", "runs": 5, "timeout": 300}
VARIANTS = ("ours_eager", "baseline_eager", "ours_compiled", "baseline_compiled")


def _rank(rank: int, world: int, cfg: dict) -> dict:
    """One rank: build the stage, fill random DTensor grads, check, count, time."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from demo.model import ModelConfig, build_model, split_stage
    from demo.parallel import apply_fsdp, apply_tp
    from ppclip_func import clip_grad_norm_, global_grad_norm

    pp, dp, tp = MESHES[world]
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh.get_coordinate()[0]
    mcfg = ModelConfig(
        vocab=cfg["vocab"], dim=cfg["dim"], n_heads=4, n_layers=cfg["layers"], hidden=cfg["dim"] * 11 // 4
    )
    model = split_stage(build_model(mcfg, seed=0), stage, pp)
    if tp > 1:
        apply_tp(model, mesh["tp"])
    if dp > 1:
        apply_fsdp(model, mesh["dp"])
    params = list(model.parameters())
    g = torch.Generator().manual_seed(1 + rank)
    for p in params:
        local = torch.empty_like(p.to_local()).uniform_(-1.0, 1.0, generator=g)
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    pp_group = mesh["pp"].get_group()
    info = {
        "leaves_on_stage": len(params),
        "local_elements": sum(p.to_local().numel() for p in params),
        "placements": sorted({str(tuple(p.placements)) for p in params}),
    }

    # Both must agree on the norm before either is timed (neither has clipped anything yet).
    ours_norm = float(global_grad_norm([p.grad for p in params], mesh))
    base_norm = float(torchtitan_norm(params, 2.0, pp_group))
    info["norm"] = ours_norm
    info["norm_rel_diff"] = abs(ours_norm - base_norm) / base_norm

    def ours(ps):
        return clip_grad_norm_(ps, mesh, 1.0)

    def baseline(ps):
        return torchtitan_clip(ps, 1.0, 2.0, pp_group)

    variants: dict[str, Callable[[], object]] = {
        "ours_eager": lambda: ours(params),
        "baseline_eager": lambda: baseline(params),
    }
    errors: dict[str, str] = {}
    compile_s: dict[str, float] = {}
    graph_breaks: dict[str, int] = {}
    if cfg["backend"]:
        torch.compile(lambda x: x + 1, backend=cfg["backend"])(torch.ones(1))  # one-time start-up, outside compile_s
        for name, fn in (("ours_compiled", ours), ("baseline_compiled", baseline)):
            fullgraph = name == "ours_compiled"  # the baseline's c10d all_reduce may break the graph; let it
            c = torch.compile(fn, fullgraph=fullgraph, backend=cfg["backend"])
            breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
            t0 = time.perf_counter()
            try:
                c(params)
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                traceback.print_exc()
                continue
            finally:
                dist.barrier()  # a rank that failed still meets the others here
            compile_s[name] = time.perf_counter() - t0
            graph_breaks[name] = sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks
            variants[name] = lambda c=c: c(params)
    # A rank whose compile failed must not time a variant the others time (collectives would mismatch).
    failed: list = [None] * world
    dist.all_gather_object(failed, sorted(errors))
    for name in {n for f in failed for n in f}:
        variants.pop(name, None)
    counts = {name: count_collectives(fn) for name, fn in variants.items()}
    t = interleaved(variants, runs=cfg["runs"], warmup=2, barrier=dist.barrier)
    return {
        "info": info,
        "counts": counts,
        "samples": t.samples,
        "errors": errors,
        "compile_s": compile_s,
        "graph_breaks": graph_breaks,
    }


def _world(world: int, cfg: dict) -> dict:
    ranks = spawn(_rank, world, cfg, timeout=cfg["timeout"])
    names = list(ranks[0]["samples"])
    # Per round, a clip takes as long as its slowest rank.
    slowest = Timings({n: [max(r["samples"][n][i] for r in ranks) for i in range(cfg["runs"])] for n in names})
    out = {
        "world": world,
        "mesh": dict(zip(("pp", "dp", "tp"), MESHES[world])),
        "leaves_per_stage": sorted({r["info"]["leaves_on_stage"] for r in ranks}),
        "local_elements_per_rank": sorted({r["info"]["local_elements"] for r in ranks}),
        "placements": sorted({p for r in ranks for p in r["info"]["placements"]}),
        "norm_max_rel_diff_ours_vs_baseline": max(r["info"]["norm_rel_diff"] for r in ranks),
        "ms": slowest.all_ms(),
        "collectives_per_clip": {n: max(r["counts"][n] for r in ranks) for n in names},
        "speedup_ours_over_baseline": {
            mode: slowest.ratio(f"baseline_{mode}", f"ours_{mode}")
            for mode in ("eager", "compiled")
            if f"ours_{mode}" in names and f"baseline_{mode}" in names
        },
    }
    compile_s = {n: statistics.median(r["compile_s"][n] for r in ranks) for n in ranks[0]["compile_s"]}
    if compile_s:
        out["compile_s_median_rank"] = compile_s
        out["graph_breaks"] = {n: max(r["graph_breaks"][n] for r in ranks) for n in ranks[0]["graph_breaks"]}
    errors = {f"rank{i}/{k}": v for i, r in enumerate(ranks) for k, v in r["errors"].items()}
    if errors:
        out["errors"] = errors
    return out


def run(quick: bool = False, out: pathlib.Path | None = None) -> dict:
    """Runs every world size; writes ``<out>/distributed.json`` and returns it."""
    cfg = QUICK if quick else FULL
    result: dict = {
        "study": NAME,
        "quick": quick,
        "machine": machine(),
        "runs": cfg["runs"],
        "warmup": 2,
        "model": {k: cfg[k] for k in ("dim", "layers", "vocab")},
        "compile_backend": cfg["backend"],
        "worlds": [],
    }
    for world in cfg["worlds"]:
        result["worlds"].append(_world(world, cfg))
    out = out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def plot(result: dict, path: pathlib.Path) -> None:
    """Time per clip per variant and world size, collectives per clip on each bar."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    worlds = result["worlds"]
    width = 0.8 / len(VARIANTS)
    for i, v in enumerate(VARIANTS):
        xs = [j + (i - (len(VARIANTS) - 1) / 2) * width for j in range(len(worlds))]
        ys = [w["ms"].get(v, 0.0) for w in worlds]
        ax.bar(xs, ys, width, label=v, hatch="//" if "baseline" in v else None)
        for x, w, y in zip(xs, worlds, ys):
            if v in w["ms"]:
                ax.text(x, y, f"{w['collectives_per_clip'][v]} coll.", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(worlds)), [f"{w['world']} ranks {tuple(w['mesh'].values())}" for w in worlds])
    ax.set_ylabel("ms per clip, slowest rank (lower is better)")
    ax.set_title("Clip over (pp, dp, tp) gloo ranks: ours vs torchtitan-style")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    r = run(quick=parser.parse_args().quick)
    for w in r["worlds"]:
        print(f"{w['world']} ranks {w['mesh']}: speed-up {w['speedup_ours_over_baseline']}")
        for v, ms in w["ms"].items():
            print(f"  {v:<18} {ms:8.2f} ms  {w['collectives_per_clip'][v]} collectives")


if __name__ == "__main__":
    main()
