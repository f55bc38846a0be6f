"""Study 3, real gloo ranks: ours against torchtitan's own clip, per clip and per collective.

Two cases per world size, each with random DTensor gradients of the real
layouts (the same values on every replica of an element; see :func:`_fill_grads`):

* ``dense``: the demo's transformer split into 2 pipeline stages,
  tensor-parallelized (``parallelize_module``) and sharded with FSDP2
  (``fully_shard``) as in the demo (``_StridedShard``/``Shard`` over ``dp`` ×
  ``Shard`` or ``Replicate`` over ``tp``). 4 ranks: ``(pp, dp, tp) = (2, 2, 1)``
  (FSDP × PP, the torchtitan#596 case); 8 ranks: ``(2, 2, 2)``.
* ``ep``: the same model (``demo/model.py``) with a MoE
  feed-forward in every other layer, world mesh ``(pp, dp_shard) = (2, world/2)``;
  the experts are sharded on the expert dim over ``ep = 2`` and by FSDP over
  ``dp_shard_mod_ep`` (``dp_shard`` unflattened into ``(world/4, 2)``), the
  rest by FSDP over ``dp_shard``, as torchtitan lays out expert parallelism
  (``tests/test_layouts.py``, ``pp_fsdp2_ep``).

Variants, each clipping in place with ``max_norm=1``:

* ``ours_eager`` / ``ours_compiled``: ``ppclip_func.clip_grad_norm_(params, mesh, 1.0)``;
* ``baseline_eager`` / ``baseline_compiled``: torchtitan 0.3.0's
  ``torchtitan.distributed.utils.clip_grad_norm_(params, 1.0, foreach=True,
  pp_mesh=mesh["pp"], ep_enabled=...)``, the call its trainer makes
  (``bench/_torchtitan.py``; ``ep_enabled=True`` in the ``ep`` case). Without
  torchtitan installed (CI) the same algorithm written here stands in, and
  the results' ``baseline`` says which ran.

Time per clip is the slowest rank's time of each round (all ranks start a
round together after a barrier), median over interleaved rounds after
warm-up. Collectives per clip are counted on one call of each variant, from
the profiler's communication-backend events (``gloo:all_reduce``, ...), which
also sees the collectives of a compiled graph; ``collectives_per_clip`` is the
most any rank issued (``collectives_by_stage`` per pipeline stage). The
baseline is compiled without ``fullgraph`` (its graph breaks are counted);
ours with ``fullgraph=True``.

Before timing, both norms are computed for ``norm_type`` 2, 1, inf, -inf
and 0 and compared with a float64 reference (every leaf's ``full_tensor()``,
statistics combined over the stages); ``norm_types`` in the results holds
each value and ``disagreements`` lists where one is off. Found with
torchtitan 0.3.0 and a pipeline mesh, in both cases (ours agrees with the
reference for every norm type):

* ``-inf``: torchtitan reduces over the pipeline with ``MAX`` (and combines
  the expert and dense norms with ``torch.maximum``), since it tests
  ``math.isinf(norm_type)``; it returns the largest per-stage minimum, not the
  minimum, and scales the grads by it. (The grads here are bounded away from
  0 differently on each stage, so this shows; with exact zeros on every
  stage both would return 0.)
* ``0``: torchtitan raises ``ZeroDivisionError`` (``total_norm **= 1.0 / norm_type``)
  after the per-stage reduction, on every rank, before clipping; with
  ``ep_enabled`` it raises even without a pipeline mesh (read in its source).

Norm types 2 and inf agree. For 1, torchtitan's fp32 sums are 0.6e-5 to
4e-5 off the reference (ours: under 1e-7), within the 1e-3 taken as agreement.

    python -m bench.distributed_study [--quick]    # --quick: 4 ranks, small models, aot_eager
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import statistics
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from bench import _report, _torchtitan
from bench._dist import count_collectives, spawn
from bench._timing import Timings, interleaved, machine

NAME = "distributed"
RESULTS = pathlib.Path(__file__).parent / "results"
DENSE_MESHES = {4: (2, 2, 1), 8: (2, 2, 2)}  # (pp, dp, tp)
EP = 2  # experts sharded over 2 ranks; the ep case's world mesh is (pp, dp_shard) = (2, world // 2)
FULL = {
    "worlds": [4, 8],
    "cases": ["dense", "ep"],
    "dim": 256,
    "layers": 16,
    "vocab": 8192,
    "experts": 8,
    "backend": "inductor",
    "runs": 9,
    "timeout": 3600,
}
# aot_eager: the compiled variants are traced but not code-generated; a check, not a measurement.
QUICK = {
    "worlds": [4],
    "cases": ["dense", "ep"],
    "dim": 64,
    "layers": 4,
    "vocab": 512,
    "experts": 4,
    "backend": "aot_eager",
    "runs": 5,
    "timeout": 300,
}
VARIANTS = ("ours_eager", "baseline_eager", "ours_compiled", "baseline_compiled")
NORM_TYPES = (2.0, 1.0, math.inf, -math.inf, 0.0)
# Both accumulate in float32 on this rank; torch's CPU norm kernel loses ~1e-4 relative on a
# 2M-element leaf (the embedding), so agreement is judged at 1e-3 and the error itself is recorded.
AGREE_REL = 1e-3


def _mesh_shape(case: str, world: int) -> dict[str, int]:
    if case == "dense":
        return dict(zip(("pp", "dp", "tp"), DENSE_MESHES[world]))
    return {"pp": 2, "dp_shard": world // 2, "dp_shard_mod_ep": world // 2 // EP, "ep": EP}


def _build(case: str, world: int, cfg: dict):
    """This rank's stage of the case's model, parallelized; returns (world mesh, stage, parameters)."""
    from torch.distributed.device_mesh import init_device_mesh

    from demo.model import ModelConfig, build_model, split_stage
    from demo.parallel import apply_ep, apply_fsdp, apply_tp

    shape = _mesh_shape(case, world)
    mcfg = ModelConfig(
        vocab=cfg["vocab"], dim=cfg["dim"], n_heads=4, n_layers=cfg["layers"], hidden=cfg["dim"] * 11 // 4
    )
    if case == "dense":
        mesh = init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
        stage = mesh.get_coordinate()[0]
        model = split_stage(build_model(mcfg, seed=0), stage, shape["pp"])
        if shape["tp"] > 1:
            apply_tp(model, mesh["tp"])
        if shape["dp"] > 1:
            apply_fsdp(model, mesh["dp"])
        return mesh, stage, list(model.parameters())

    mesh = init_device_mesh("cpu", (shape["pp"], shape["dp_shard"]), mesh_dim_names=("pp", "dp_shard"))
    # By index: torch 2.11's _unflatten refuses a dim given by its name.
    experts_mesh = mesh._unflatten(1, (shape["dp_shard_mod_ep"], EP), ("dp_shard_mod_ep", "ep"))
    stage = mesh.get_coordinate()[0]
    mcfg = dataclasses.replace(mcfg, moe_layers=tuple(range(1, cfg["layers"], 2)), n_experts=cfg["experts"])
    model = split_stage(build_model(mcfg, seed=0), stage, shape["pp"])
    apply_ep(model, experts_mesh["ep"])
    apply_fsdp(model, mesh["dp_shard"], expert_dp_mesh=experts_mesh["dp_shard_mod_ep"])
    return mesh, stage, list(model.parameters())


def _fill_grads(params: list[torch.Tensor], stage: int) -> None:
    """Random DTensor grads of each parameter's layout, equal on the ranks that replicate an element.

    Magnitudes on stage ``s`` lie in ``[(s + 1) / 10, 1)``, with random signs: no
    element is 0 and the stages' smallest magnitudes differ, so a ``-inf`` norm
    reduced over the pipeline with the wrong operation shows.
    """
    from torch.distributed.tensor import DTensor

    for i, p in enumerate(params):
        coord = p.device_mesh.get_coordinate()
        sharded_at = [c for c, pl in zip(coord, p.placements) if not pl.is_replicate()]
        g = torch.Generator().manual_seed(hash((stage, i, *sharded_at)) & 0xFFFF_FFFF)
        shape = p.to_local().shape
        sign = torch.randint(0, 2, shape, generator=g, dtype=p.dtype) * 2 - 1
        local = torch.empty(shape, dtype=p.dtype).uniform_((stage + 1) / 10, 1.0, generator=g) * sign
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )


def _reference_norms(params: list[torch.Tensor], stage: int) -> dict[float, float]:
    """Every norm type in float64, the obvious way: whole leaves (``full_tensor()``), stages combined."""
    s = {"sum1": 0.0, "sum2": 0.0, "max": 0.0, "min": math.inf, "nonzero": 0}
    for p in params:
        x = p.grad.full_tensor().to(torch.float64).abs().reshape(-1)
        s["sum1"] += float(x.sum())
        s["sum2"] += float((x * x).sum())
        s["max"] = max(s["max"], float(x.max()))
        s["min"] = min(s["min"], float(x.min()))
        s["nonzero"] += int((x != 0).sum())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (stage, s))
    stages = dict(everyone)  # the ranks of one stage hold the same whole leaves
    return {
        2.0: math.sqrt(sum(v["sum2"] for v in stages.values())),
        1.0: sum(v["sum1"] for v in stages.values()),
        math.inf: max(v["max"] for v in stages.values()),
        -math.inf: min(v["min"] for v in stages.values()),
        0.0: float(sum(v["nonzero"] for v in stages.values())),
    }


def _compare_norms(params, mesh, stage: int, baseline: Callable[..., torch.Tensor]) -> dict[str, dict]:
    """Ours and the baseline for each of :data:`NORM_TYPES`, against the float64 reference.

    The baseline clips in place (torchtitan has no measure-only call), so
    every grad is restored after it.
    """
    from ppclip_func import global_grad_norm

    reference = _reference_norms(params, stage)
    grads = [p.grad for p in params]
    saved = [g.to_local().clone() for g in grads]
    out = {}
    for nt in NORM_TYPES:
        row: dict = {"reference": reference[nt], "ours": float(global_grad_norm(grads, mesh, nt))}
        try:
            row["baseline"] = float(baseline(params, norm_type=nt))
        except Exception as e:
            row["baseline_error"] = f"{type(e).__name__}: {e}"
        for g, s in zip(grads, saved):
            g.to_local().copy_(s)
        dist.barrier()
        out[str(nt)] = row
    return out


def _case(case: str, rank: int, world: int, cfg: dict) -> dict:
    """One case on one rank: build the stage, fill grads, compare norms, count, time."""
    from ppclip_func import clip_grad_norm_

    torch._dynamo.reset()
    mesh, stage, params = _build(case, world, cfg)
    _fill_grads(params, stage)
    pp_mesh = mesh["pp"]
    ep_enabled = case == "ep"
    info = {
        "stage": stage,
        "leaves_on_stage": len(params),
        "local_elements": sum(p.to_local().numel() for p in params),
        "placements": sorted({f"{p.device_mesh.mesh_dim_names}: {tuple(p.placements)}" for p in params}),
    }

    def ours(ps):
        return clip_grad_norm_(ps, mesh, 1.0)

    def baseline(ps, norm_type=2.0):
        return _torchtitan.clip(ps, 1.0, pp_mesh, ep_enabled=ep_enabled, norm_type=norm_type)

    # Both must agree on the norm before either is timed (neither has clipped anything yet).
    norms = _compare_norms(params, mesh, stage, baseline)

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
        "norms": norms,
        "counts": counts,
        "samples": t.samples,
        "errors": errors,
        "compile_s": compile_s,
        "graph_breaks": graph_breaks,
    }


def _rank(rank: int, world: int, cfg: dict) -> dict:
    """Every case, one after the other, in one start of the ranks (starting them is slow on 2 cores)."""
    return {case: _case(case, rank, world, cfg) for case in cfg["cases"]}


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / abs(b) if b else math.inf


def _norm_table(ranks: list[dict]) -> tuple[dict, list[str]]:
    """Per norm type: the reference, each side's value (most-off rank) and relative error; the disagreements."""
    table, disagreements = {}, []
    for nt in ranks[0]["norms"]:
        rows = [r["norms"][nt] for r in ranks]
        ref = rows[0]["reference"]
        ours = max((r["ours"] for r in rows), key=lambda v: _rel(v, ref))
        entry = {"reference": ref, "ours": ours, "ours_rel_err": _rel(ours, ref)}
        failures = sorted({r["baseline_error"] for r in rows if "baseline_error" in r})
        if failures:
            entry["baseline_error"] = failures
            disagreements.append(f"norm_type={nt}: the baseline raised {'; '.join(failures)}")
        else:
            base = max((r["baseline"] for r in rows), key=lambda v: _rel(v, ref))
            entry |= {"baseline": base, "baseline_rel_err": _rel(base, ref)}
            if entry["baseline_rel_err"] > AGREE_REL:
                disagreements.append(
                    f"norm_type={nt}: the baseline returned {base:.6g}, the reference is {ref:.6g} "
                    f"(relative error {entry['baseline_rel_err']:.3g})"
                )
        if entry["ours_rel_err"] > AGREE_REL:
            disagreements.append(f"norm_type={nt}: ours returned {ours:.6g}, the reference is {ref:.6g}")
        table[nt] = entry
    return table, disagreements


def _summarize(case: str, world: int, ranks: list[dict], cfg: dict) -> dict:
    names = list(ranks[0]["samples"])
    # Per round, a clip takes as long as its slowest rank.
    slowest = Timings({n: [max(r["samples"][n][i] for r in ranks) for i in range(cfg["runs"])] for n in names})
    norms, disagreements = _norm_table(ranks)
    two = norms[str(2.0)]
    n_stages = _mesh_shape(case, world)["pp"]
    out = {
        "world": world,
        "case": case,
        "mesh": _mesh_shape(case, world),
        "leaves_per_stage": sorted({r["info"]["leaves_on_stage"] for r in ranks}),
        "local_elements_per_rank": sorted({r["info"]["local_elements"] for r in ranks}),
        "placements": sorted({p for r in ranks for p in r["info"]["placements"]}),
        "norm_max_rel_diff_ours_vs_baseline": _rel(two["ours"], two["baseline"]) if "baseline" in two else None,
        "norm_types": norms,
        "disagreements": disagreements,
        "ms": slowest.all_ms(),
        "collectives_per_clip": {n: max(r["counts"][n] for r in ranks) for n in names},
        "collectives_by_stage": {
            n: [max(r["counts"][n] for r in ranks if r["info"]["stage"] == s) for s in range(n_stages)] for n in names
        },
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
    """Runs every world size and case; writes ``<out>/distributed.json`` and returns it."""
    cfg = QUICK if quick else FULL
    if not _torchtitan.INSTALLED:
        print(f"[bench] distributed: baseline {_torchtitan.SOURCE}", flush=True)
    result: dict = {
        "study": NAME,
        "quick": quick,
        "machine": machine(),
        "runs": cfg["runs"],
        "warmup": 2,
        "baseline": _torchtitan.SOURCE,
        "norm_agree_rel": AGREE_REL,
        "model": {k: cfg[k] for k in ("dim", "layers", "vocab", "experts")},
        "compile_backend": cfg["backend"],
        "worlds": [],
    }
    for world in cfg["worlds"]:
        ranks = spawn(_rank, world, cfg, timeout=cfg["timeout"])
        for case in cfg["cases"]:
            result["worlds"].append(_summarize(case, world, [r[case] for r in ranks], cfg))
    out = out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _label(w: dict) -> str:
    mesh = "×".join(f"{k}{v}" for k, v in w["mesh"].items())
    return f"{w['world']} ranks, {w['case']}\n{mesh}"


def plot(result: dict, path: pathlib.Path) -> None:
    """Time per clip per variant, world size and case, collectives per clip on each bar."""
    import matplotlib.pyplot as plt

    worlds = result["worlds"]
    fig, ax = plt.subplots(figsize=(2.4 * len(worlds) + 2, 4.2))
    width = 0.8 / len(VARIANTS)
    for i, v in enumerate(VARIANTS):
        xs = [j + (i - (len(VARIANTS) - 1) / 2) * width for j in range(len(worlds))]
        ys = [w["ms"].get(v, 0.0) for w in worlds]
        ax.bar(xs, ys, width, label=v, hatch="//" if "baseline" in v else None)
        for x, w, y in zip(xs, worlds, ys):
            if v in w["ms"]:
                ax.text(x, y, f"{w['collectives_per_clip'][v]}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(worlds)), [_label(w) for w in worlds], fontsize=7)
    ax.set_ylabel("ms per clip, slowest rank (lower is better)")
    baseline = "torchtitan" if result["baseline"].startswith("torchtitan") else "torchtitan-style (written here)"
    ax.set_title(f"Clip on gloo ranks: ours vs {baseline} (number on bar: collectives per clip)", fontsize=9)
    ax.legend(fontsize=8)
    _report.save_figure(fig, path)


def main() -> None:
    r = _report.quick_cli(__doc__, run)
    print(f"baseline: {r['baseline']}")
    for w in r["worlds"]:
        print(f"{w['world']} ranks, {w['case']} {w['mesh']}: speed-up {w['speedup_ours_over_baseline']}")
        for v, ms in w["ms"].items():
            print(f"  {v:<18} {ms:8.2f} ms  {w['collectives_per_clip'][v]} collectives {w['collectives_by_stage'][v]}")
        for d in w["disagreements"]:
            print(f"  disagreement: {d}")


if __name__ == "__main__":
    main()
