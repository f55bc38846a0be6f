"""Study 6, one process on a fake process group: host time per clip against the world size.

The clip's layout analysis reads only mesh shapes and placements, but it
reads them for every leaf on every call, so its host cost can grow with the
number of ranks even though no data moves. This study measures that cost
alone: rank 0 of a fake process group (``FakeStore``, backend ``"fake"``:
collectives return at once without moving data, ``tests/_fake_pg.py``) with
the world mesh ``(pp, dp, tp) = (4, world / 8, 2)`` for 64, 1024, 16 384 and
65 536 ranks (``--quick``: 64 and 1024), and, on the ``(dp, tp)`` sub-mesh of
this rank's stage, DTensor leaves laid out as FSDP × TP lays them out:
``Shard(0)`` over ``dp`` and ``Shard(1)`` over ``tp`` (three leaves in four,
the weight matrices) or ``Replicate()`` over ``tp`` (every fourth, the norm
weights). Each leaf is a small ``8 × 16`` local block, so host work dominates.

Variants, eager, measuring the norm only:

* ``ours_eager``: ``ppclip_func.global_grad_norm(grads, mesh)`` over the world
  mesh (pipeline included);
* ``torch_eager``: ``torch.nn.utils.get_total_norm(grads, foreach=True).full_tensor()``,
  the norm over the stage's (dp, tp) ranks as torch computes it (no pipeline
  reduction: torch does not know about one).

Per world size: median ms per call over interleaved rounds after one warm-up
round; the first (warm-up) call of each, which pays the one-time costs (our
per-mesh layout tables; DTensor's sharding propagation for torch); and, apart,
the time to create the world mesh with ``init_device_mesh`` and slice its
``(dp, tp)`` sub-mesh. Goal, ours: at 16 384 ranks at most 1.5× its time at
64 ranks.

    python -m bench.ranks_study [--quick]
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from bench import _report
from bench._timing import interleaved, machine
from ppclip_func import global_grad_norm
from tests._fake_pg import fake_world

NAME = "ranks"
RESULTS = pathlib.Path(__file__).parent / "results"
FULL = {"worlds": [64, 1024, 16384, 65536], "leaves": 1000, "runs": 7}
QUICK = {"worlds": [64, 1024], "leaves": 100, "runs": 5}
PP, TP = 4, 2
LOCAL_SHAPE = (8, 16)
GOAL_WORLD, GOAL_GROWTH = 16384, 1.5
VARIANTS = ("ours_eager", "torch_eager")


def _leaves(n: int, stage_mesh) -> list[torch.Tensor]:
    """``n`` DTensor grads on the (dp, tp) mesh: FSDP ``Shard(0)`` × TP ``Shard(1)``, every fourth TP-replicated."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        tp = Replicate() if i % 4 == 3 else Shard(1)
        local = torch.empty(LOCAL_SHAPE).uniform_(-1.0, 1.0, generator=g)
        out.append(DTensor.from_local(local, stage_mesh, [Shard(0), tp], run_check=False))
    return out


@contextlib.contextmanager
def _quiet_redistribute():
    """torch's ``full_tensor()`` over (dp, tp) warns that it runs two all-reduces; that cost is measured here."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _point(world: int, n_leaves: int, runs: int) -> dict:
    with fake_world(world), _quiet_redistribute():
        t0 = time.perf_counter()
        mesh = init_device_mesh("cpu", (PP, world // (PP * TP), TP), mesh_dim_names=("pp", "dp", "tp"))
        t1 = time.perf_counter()
        stage_mesh = mesh["dp", "tp"]
        t2 = time.perf_counter()
        grads = _leaves(n_leaves, stage_mesh)
        variants = {
            "ours_eager": lambda: global_grad_norm(grads, mesh),
            "torch_eager": lambda: torch.nn.utils.get_total_norm(grads, foreach=True).full_tensor(),
        }
        t = interleaved(variants, runs=runs, warmup=1)
    return {
        "world": world,
        "mesh": {"pp": PP, "dp": world // (PP * TP), "tp": TP},
        "leaves": n_leaves,
        "mesh_create_ms": 1e3 * (t1 - t0),
        "submesh_ms": 1e3 * (t2 - t1),
        "ms": t.all_ms(),
        "first_call_ms": {k: 1e3 * v for k, v in t.first.items()},
        "ratio_torch_over_ours": t.ratio("torch_eager", "ours_eager"),
    }


def run(quick: bool = False, out: pathlib.Path | None = None) -> dict:
    """Measures every world size; writes ``<out>/ranks.json`` and returns it."""
    cfg = QUICK if quick else FULL
    points = []
    for world in cfg["worlds"]:
        points.append(_point(world, cfg["leaves"], cfg["runs"]))
        print(f"[bench] ranks: {world} ranks, ms {points[-1]['ms']}", flush=True)
    base = points[0]
    for p in points:
        p["growth_vs_smallest"] = {v: p["ms"][v] / base["ms"][v] for v in VARIANTS}
    goal = next((p for p in points if p["world"] == GOAL_WORLD), None)
    result = {
        "study": NAME,
        "quick": quick,
        "machine": machine(),
        "runs": cfg["runs"],
        "warmup": 1,
        "config": {**cfg, "pp": PP, "tp": TP, "local_shape": list(LOCAL_SHAPE)},
        "goal": f"ours at {GOAL_WORLD} ranks <= {GOAL_GROWTH}x ours at {base['world']} ranks",
        "goal_growth": None if goal is None else goal["growth_vs_smallest"]["ours_eager"],
        "points": points,
    }
    out = out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def plot(result: dict, path: pathlib.Path) -> None:
    """Host ms per call against the world size, log-log: steady calls, first calls, mesh creation."""
    import matplotlib.pyplot as plt

    pts = result["points"]
    xs = [p["world"] for p in pts]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for v in VARIANTS:
        line = ax.plot(xs, [p["ms"][v] for p in pts], marker="o", label=f"{v}, median call")[0]
        ax.plot(
            xs,
            [p["first_call_ms"][v] for p in pts],
            marker="x",
            ls="--",
            color=line.get_color(),
            label=f"{v}, first call",
        )
    ax.plot(xs, [p["mesh_create_ms"] for p in pts], marker="s", ls=":", color="gray", label="init_device_mesh")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{x:,}" for x in xs])
    ax.set_xlabel("world size (fake process group), mesh (4, world/8, 2)")
    ax.set_ylabel("host ms (lower is better)")
    ax.set_title(f"Norm of {result['config']['leaves']} DTensor leaves: host time vs ranks", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    _report.save_figure(fig, path)


def main() -> None:
    r = _report.quick_cli(__doc__, run)
    for p in r["points"]:
        cells = "  ".join(
            f"{v} {p['ms'][v]:.2f} ms (x{p['growth_vs_smallest'][v]:.2f}, first {p['first_call_ms'][v]:.0f})"
            for v in VARIANTS
        )
        print(f"{p['world']:6d} ranks: mesh {p['mesh_create_ms']:.0f} ms; {cells}")
    print(f"goal: {r['goal']}: growth {r['goal_growth']}")


if __name__ == "__main__":
    main()
