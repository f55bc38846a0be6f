"""What a benchmark run writes: each study's JSON, the Markdown summary, and plots for studies that bring none."""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
from collections.abc import Callable

__all__ = ["RESULTS", "plot_compile", "plot_ms", "summary", "write_result"]

RESULTS = pathlib.Path(__file__).parent / "results"

TORCH_COMPILE_IMPL = "torch get_total_norm + clip_grads_with_norm_"
OURS_COMPILE_IMPL = "ppclip clip_grad_norm_ (in place)"


def write_result(result: dict, out: pathlib.Path | None = None) -> pathlib.Path:
    """Writes a study's ``result`` to ``<out>/<result["study"]>.json`` (default ``bench/results``); returns the path."""
    out = out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result['study']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def _status(ok: bool | None, quick: bool) -> str:
    if quick:  # tiny sizes and aot_eager: nothing to judge a goal by
        return "n/a (--quick)"
    return "—" if ok is None else ("met" if ok else "**not met**")


def _ms(x: float | None) -> str:
    return "—" if x is None else (f"{x:.3g}" if x < 10 else f"{x:.0f}")


def _x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _goal_rows(results: dict[str, dict | None], notes: dict[str, str], quick: bool) -> list[str]:
    rows = []
    bw = results.get("bandwidth")
    if bw:
        m = bw["model"]
        for dtype, d in bw["dtypes"].items():
            f = d["fraction_of_bound"]
            ours = f.get("ours_compiled_inplace")
            measured = (
                f"ours compiled in place {_x(ours)} of the bound ({_ms(d['ms'].get('ours_compiled_inplace'))} ms), "
                f"pure {_x(f.get('ours_compiled_pure'))}; torch eager foreach {_x(f.get('torch_eager'))}, "
                f"torch compiled {_x(f.get('torch_compiled'))}; bound {_ms(d['ms']['bound_inplace'])} ms"
            )
            goal = "compiled in place ≥ 0.9 of bound"
            ok = (ours >= 0.9) if ours is not None else False
            rows.append(
                f"| 1. Bandwidth, {dtype}, {m['params'] / 1e6:.1f} M params, {m['leaves']} leaves "
                f"| {measured} | {goal} | {_status(ok, quick)} |"
            )
    else:
        rows.append(f"| 1. Bandwidth | {notes.get('bandwidth', 'not run')} | compiled in place ≥ 0.9 of bound | — |")

    lv = results.get("leaves")
    if lv:
        for series, points in lv["series"].items():
            p = points[-1]
            r = p["ratio_torch_over_ours"]
            measured = (
                f"at {p['leaves']:,} leaves ({p['elements'] / 2**20:.3g} Mi elements): torch/ours time "
                f"eager {_x(r.get('eager'))}x, DTensor eager {_x(r.get('dtensor_eager'))}x"
            )
            first = p.get("first_call_ms", {})
            if "torch_dtensor_eager" in first and "ours_dtensor_eager" in first:
                measured += (
                    f"; first DTensor call torch {first['torch_dtensor_eager'] / 1e3:.2g} s, "
                    f"ours {first['ours_dtensor_eager'] / 1e3:.2g} s"
                )
            compiled = [q for q in points if "compiled" in q["ratio_torch_over_ours"]]
            if compiled:
                q = compiled[-1]
                measured += f", compiled {_x(q['ratio_torch_over_ours']['compiled'])}x at {q['leaves']:,}"
            rows.append(f"| 2. Leaf scaling, {series.replace('_', ' ')} | {measured} | (reported) | — |")
    else:
        rows.append(f"| 2. Leaf scaling | {notes.get('leaves', 'not run')} | (reported) | — |")

    ds = results.get("distributed")
    if ds:
        titan = ds.get("baseline", "").startswith("torchtitan")
        for w in ds["worlds"]:
            c = w["collectives_per_clip"]
            s = w["speedup_ours_over_baseline"]
            mesh = "×".join(f"{k}{v}" for k, v in w["mesh"].items())
            case = w.get("case", "dense")
            measured = (
                f"eager: ours {_ms(w['ms'].get('ours_eager'))} ms, {c.get('ours_eager')} collective(s); "
                f"{'torchtitan' if titan else 'baseline'} {_ms(w['ms'].get('baseline_eager'))} ms, "
                f"{c.get('baseline_eager')}; speed-up {_x(s.get('eager'))}x"
            )
            if "ours_compiled" in c:
                measured += (
                    f". compiled: ours {_ms(w['ms'].get('ours_compiled'))} ms, {c['ours_compiled']}; baseline "
                    f"{_ms(w['ms'].get('baseline_compiled'))} ms, {c.get('baseline_compiled')}; "
                    f"speed-up {_x(s.get('compiled'))}x"
                )
            norms, rel = w.get("norm_types", {}), ds.get("norm_agree_rel")
            if norms and rel is not None:
                off = [nt for nt, e in norms.items() if "baseline_error" in e or e["baseline_rel_err"] > rel]
                ours_off = [nt for nt, e in norms.items() if e["ours_rel_err"] > rel]
                measured += (
                    f". Norm types {', '.join(norms)} against float64 (wrong: raised, or off by > {rel:g}): "
                    f"baseline wrong for {', '.join(off) or 'none'}, ours for {', '.join(ours_off) or 'none'}"
                )
            one = all(v == 1 for k, v in c.items() if k.startswith("ours"))
            goal = "1 collective" + ("; ≥ 2x faster eager" if w["world"] == 8 else "")
            ok = one and (w["world"] != 8 or (s.get("eager") or 0) >= 2.0)
            rows.append(
                f"| 3. Distributed, {w['world']} gloo ranks, {case} ({mesh}) | {measured} | {goal} "
                f"| {_status(ok, quick)} |"
            )
    else:
        rows.append(f"| 3. Distributed | {notes.get('distributed', 'not run')} | 1 collective; ≥ 2x faster | — |")

    cp = results.get("compile")
    if cp and cp.get("compile_time"):
        by = {(r["impl"], r["leaves"], r["backend"]): r["compile_s"] for r in cp["compile_time"]}
        for backend in sorted({r["backend"] for r in cp["compile_time"]}):
            for n in sorted({r["leaves"] for r in cp["compile_time"] if r["backend"] == backend}):
                ours, ref = by.get((OURS_COMPILE_IMPL, n, backend)), by.get((TORCH_COMPILE_IMPL, n, backend))
                if ours is None or ref is None:
                    continue
                ok = ours <= ref if backend == "inductor" else None
                rows.append(
                    f"| 4. Compile time, {n} leaves ({backend}) | ours {ours:.1f} s, torch {ref:.1f} s "
                    f"| not above torch's | {_status(ok, quick)} |"
                )
    else:
        rows.append(f"| 4. Compile time | {notes.get('compile', 'not run')} | not above torch's | — |")

    gpu = results.get("gpu")
    if gpu:
        d = gpu["dtypes"]["bfloat16"]
        f = d["fraction_of_bound"]
        ours = f.get("ours_compiled_inplace")
        measured = (
            f"{gpu['device']}, {gpu['model']['params'] / 1e9:.2f} G bf16 params: ours compiled in place "
            f"{_x(ours)} of the HBM bound ({_ms(d['ms'].get('ours_compiled_inplace'))} ms; bound "
            f"{d['bound_GBps']['bound_inplace']:.0f} GB/s), eager {_x(f.get('ours_eager_inplace'))}; "
            f"torch eager foreach {_x(f.get('torch_eager'))}, compiled {_x(f.get('torch_compiled'))}"
        )
        ok = ours is not None and ours >= 0.9
        rows.append(f"| 5. GPU | {measured} | compiled in place ≥ 0.9 of bound | {_status(ok, quick)} |")
    else:
        rows.append(f"| 5. GPU | not measured ({notes.get('gpu', 'no GPU in this run')}) | — | — |")

    rk = results.get("ranks")
    if rk:
        pts = rk["points"]
        first, last = pts[0], pts[-1]
        measured = "; ".join(
            f"{p['world']:,}: ours {_ms(p['ms']['ours_eager'])} ms (x{_x(p['growth_vs_smallest']['ours_eager'])}), "
            f"torch {_ms(p['ms']['torch_eager'])} ms"
            for p in pts
        )
        measured += (
            f" ({rk['config']['leaves']} leaves). First call at {last['world']:,}: ours "
            f"{_ms(last['first_call_ms']['ours_eager'])} ms, torch {_ms(last['first_call_ms']['torch_eager'])} ms; "
            f"init_device_mesh {_ms(last['mesh_create_ms'])} ms"
        )
        growth = rk.get("goal_growth")
        ok = None if growth is None else growth <= 1.5
        rows.append(
            f"| 6. Host time vs ranks (fake PG), {first['world']:,} → {last['world']:,} ranks | {measured} "
            f"| ours at 16,384 ranks ≤ 1.5x at 64 | {_status(ok, quick)} |"
        )
    else:
        rows.append(f"| 6. Host time vs ranks | {notes.get('ranks', 'not run')} | ours at 16,384 ≤ 1.5x at 64 | — |")
    op = results.get("optimizer")
    for s in op["settings"] if op else []:
        r, comp = s["eager_ratio_vs_torch"], s.get("compiled_ratio_vs_torch") or {}
        handed_goal = 0.9 if s["dtype"] == "float32" else 1.0
        skip_over = s["eager_ratio_vs_handed"]["handed_skipped"]
        adaptive_over = s["eager_ratio_vs_handed"]["handed_adaptive"]
        measured = (
            f"eager handed {_x(r['handed'])}x torch's clip + step (in place {_x(r['ours_inplace'])}x, step alone "
            f"{_x(r['step_only'])}x); adaptive {_x(adaptive_over)}x and skipped {_x(skip_over)}x a handed step"
        )
        oks = [r["handed"] <= handed_goal, skip_over <= 1.05, adaptive_over <= 1.05]
        goal = f"eager ≤ {handed_goal}x torch, adaptive and skipped ≤ 1.05x handed"
        if comp:
            measured += f"; compiled {_x(comp['ours'])}x torch's compiled clip + step"
            goal += ", compiled ≤ 1.0x"
            oks.append(comp["ours"] <= 1.0)
        rows.append(
            f"| 8. Optimizer step, {s['setting']}, {s['dtype']} | {measured} | {goal} | {_status(all(oks), quick)} |"
        )
    sw = results.get("sweep")
    rows += _sweep_rows(sw, quick) if sw else [f"| 9. Sweep | {notes.get('sweep', 'not run')} | (see study) | — |"]
    return rows


def _bandwidth_table(bw: dict) -> list[str]:
    dtypes = list(bw["dtypes"])
    head = "| variant | " + " | ".join(f"{d} ms | {d} of bound" for d in dtypes) + " |"
    lines = [head, "|---" * (1 + 2 * len(dtypes)) + "|"]
    names = list(next(iter(bw["dtypes"].values()))["ms"])
    for v in names:
        cells = []
        for d in dtypes:
            dd = bw["dtypes"][d]
            cells += [_ms(dd["ms"].get(v)), _x(dd["fraction_of_bound"].get(v)) if not v.startswith("bound") else "1"]
        lines.append(f"| `{v}` | " + " | ".join(cells) + " |")
    gbps = ", ".join(f"{d}: {bw['dtypes'][d]['bound_GBps']['bound_inplace']:.1f} GB/s" for d in dtypes)
    lines.append("")
    lines.append(f"Bound bandwidth (three passes over the buffer): {gbps}.")
    return lines


def _leaves_table(lv: dict) -> list[str]:
    variants = [
        "torch_eager",
        "ours_eager",
        "torch_compiled",
        "ours_compiled",
        "torch_dtensor_eager",
        "ours_dtensor_eager",
    ]
    lines = ["| series | leaves | " + " | ".join(f"`{v}` ms" for v in variants) + " |"]
    lines.append("|---" * (2 + len(variants)) + "|")
    for series, points in lv["series"].items():
        for p in points:
            lines.append(f"| {series} | {p['leaves']:,} | " + " | ".join(_ms(p["ms"].get(v)) for v in variants) + " |")
    return lines


def _distributed_table(ds: dict) -> list[str]:
    lines = [
        f"Baseline: {ds.get('baseline', 'written here')}.",
        "",
        "| ranks | case | mesh | variant | ms per clip | collectives per clip (per stage) |",
        "|---|---|---|---|---|---|",
    ]
    for w in ds["worlds"]:
        mesh = ", ".join(f"{k} {v}" for k, v in w["mesh"].items())
        by_stage = w.get("collectives_by_stage", {})
        for v, ms in w["ms"].items():
            per_stage = f" ({', '.join(map(str, by_stage[v]))})" if v in by_stage else ""
            lines.append(
                f"| {w['world']} | {w.get('case', 'dense')} | {mesh} | `{v}` | {_ms(ms)} "
                f"| {w['collectives_per_clip'][v]}{per_stage} |"
            )
    rows = [(w, nt, e) for w in ds["worlds"] for nt, e in w.get("norm_types", {}).items()]
    if rows:
        lines += ["", "| ranks | case | norm_type | float64 reference | ours (rel. error) | baseline (rel. error) |"]
        lines.append("|---|---|---|---|---|---|")
        for w, nt, e in rows:
            base = (
                "raised " + "; ".join(e["baseline_error"])
                if "baseline_error" in e
                else f"{e['baseline']:.7g} ({e['baseline_rel_err']:.2g})"
            )
            lines.append(
                f"| {w['world']} | {w.get('case', 'dense')} | {nt} | {e['reference']:.7g} "
                f"| {e['ours']:.7g} ({e['ours_rel_err']:.2g}) | {base} |"
            )
    return lines


def _ranks_table(rk: dict) -> list[str]:
    lines = [
        "| ranks | mesh (pp, dp, tp) | init_device_mesh ms | variant | ms per call | x vs smallest | first call ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in rk["points"]:
        mesh = tuple(p["mesh"].values())
        for v, ms in p["ms"].items():
            lines.append(
                f"| {p['world']:,} | {mesh} | {_ms(p['mesh_create_ms'])} | `{v}` | {_ms(ms)} "
                f"| {_x(p['growth_vs_smallest'][v])} | {_ms(p['first_call_ms'][v])} |"
            )
    return lines


def _compile_table(cp: dict) -> list[str]:
    lines = ["| implementation | leaves | backend | compile s |", "|---|---|---|---|"]
    for r in cp.get("compile_time", []):
        lines.append(f"| {r['impl']} | {r['leaves']} | {r['backend']} | {r['compile_s']:.1f} |")
    return lines


def _features_table(ft: dict) -> list[str]:
    variants = ("adaptive", "adaptive_skip", "param_norms")
    lines = [
        "| setting | leaves | plain eager ms | "
        + " | ".join(f"{v} eager" for v in variants)
        + " | "
        + " | ".join(f"{v} compiled" for v in variants)
        + " | skip_update_ over AdamW step, eager | compiled |",
        "|---|---|---|" + "---|" * (2 * len(variants)) + "---|---|",
    ]
    for s in ft.get("settings", []):
        eager = " | ".join(_x(s["eager_ratio_vs_plain"][v]) for v in variants)
        comp = s.get("compiled_ratio_vs_plain")
        compiled = " | ".join(_x(comp.get(v)) if comp else "—" for v in variants)
        lines.append(
            f"| {s['setting']} | {s['leaves']:,} | {_ms(s['eager_ms']['plain'])} | {eager} | {compiled} "
            f"| {_x(s['skippable_over_adamw'])} | {_x(s.get('skippable_over_adamw_compiled'))} |"
        )
    return lines


def _optimizer_table(op: dict) -> list[str]:
    variants = ("step_only", "ours_inplace", "handed", "handed_adaptive", "handed_skipped", "skip_update")
    lines = [
        "| setting | dtype | torch clip + step ms | "
        + " | ".join(variants)
        + " | compiled: ours | ours + skip_update_ | skipped step MiB beyond the norm: handed | skip_update_ |",
        "|---|---|---|" + "---|" * len(variants) + "---|---|---|---|",
    ]
    for s in op.get("settings", []):
        eager = " | ".join(_x(s["eager_ratio_vs_torch"][v]) for v in variants)
        comp = s.get("compiled_ratio_vs_torch") or {}
        b = s["bytes_allocated"]
        extra = [(b[k] - b["norm_only"]) / 2**20 for k in ("handed_skipped", "skip_update")]
        lines.append(
            f"| {s['setting']} | {s['dtype']} | {_ms(s['eager_ms']['torch'])} | {eager} | {_x(comp.get('ours'))} "
            f"| {_x(comp.get('ours_skip_update'))} | {extra[0]:.2f} | {extra[1]:.1f} |"
        )
    return lines


def _sweep_points(sw: dict) -> list[dict]:
    return [p for series in ("fixed_total", "fixed_leaf", "dtensor", "step") for p in sw["series"].get(series, [])]


def _sweep_rows(sw: dict, quick: bool) -> list[str]:
    """Study 9's goals: compiled ≤ 1.0x torch's at every point, within 1e-6 of float64; the step ≤ 0.9x."""
    points = _sweep_points(sw)
    clip = [p for p in points if "compiled" in p["ratio_ours_over_torch"]]
    steps = [p for p in points if "step" in p["ratio_ours_over_torch"]]
    worst = max(clip, key=lambda p: p["ratio_ours_over_torch"]["compiled"], default=None)
    errs = [p["rel_error"].get("ours_compiled", p["rel_error"].get("ours_step")) for p in points]
    err = max((e for e in errs if e is not None), default=None)
    rows = []
    if worst:
        r = worst["ratio_ours_over_torch"]["compiled"]
        measured = (
            f"worst of {len(clip)} points {_x(r)}x ({worst['leaves']} × {worst['leaf_size']:,} {worst['dtype']}); "
            f"largest error against float64 {err:.2g}"
        )
        ok = r <= 1.0 and err is not None and err <= 1e-6
        rows.append(
            f"| 9. Sweep, compiled in-place clip | {measured} | ≤ 1.0x torch's, ≤ 1e-6 | {_status(ok, quick)} |"
        )
    if steps:
        r = max(p["ratio_ours_over_torch"]["step"] for p in steps)
        rows.append(
            f"| 9. Sweep, compiled optimizer step | worst {_x(r)}x torch's | ≤ 0.9x | {_status(r <= 0.9, quick)} |"
        )
    ops = sw.get("host_ops")
    if ops:
        most = max(v["ours"] for v in ops.values())
        measured = ", ".join(f"{n} leaves: {v['ours']} (torch {v['torch']})" for n, v in ops.items())
        rows.append(f"| 9. Ops per eager clip, accelerator branch | {measured} | ≤ 64 | {_status(most <= 64, quick)} |")
    return rows


def _sweep_table(sw: dict) -> list[str]:
    lines = [
        "| series | leaves × size | dtype | torch eager ms | ours/torch eager | torch compiled ms "
        "| ours/torch compiled | compile CPU s torch / ours | error torch / ours |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for series, points in sw["series"].items():
        for p in points:
            r, ms, c, e = p["ratio_ours_over_torch"], p["ms"], p.get("compile_cpu_s", p["compile_s"]), p["rel_error"]
            key = "step" if "step" in r else "compiled"
            theirs, ours = ("torch_step", "ours_step") if key == "step" else ("torch_compiled", "ours_compiled")
            lines.append(
                f"| {series} | {p['leaves']} × {p['leaf_size']:,} | {p['dtype']} | {_ms(ms.get('torch_eager'))} "
                f"| {_x(r.get('eager'))} | {_ms(ms.get(theirs))} | {_x(r.get(key))} "
                f"| {c.get(theirs, 0):.1f} / {c.get(ours, 0):.1f} | {e.get(theirs, 0):.1g} / {e.get(ours, 0):.1g} |"
            )
    return lines


def summary(results: dict[str, dict | None], notes: dict[str, str], quick: bool, seconds: dict[str, float]) -> str:
    """The Markdown the README includes: the goals table, then one table per study."""
    machine = next((r["machine"] for r in results.values() if r and "machine" in r), {})
    when = datetime.datetime.now().strftime("%Y-%m-%d")
    lines = [
        f"Measured by `python -m bench{' --quick' if quick else ''}` on {when}: {machine.get('platform', '?')}, "
        f"torch {machine.get('torch', '?')}, {machine.get('torch_threads', '?')} torch threads. Every ratio "
        "comes from one run: variants interleaved round by round, median of the per-round ratios after warm-up.",
        "",
        "| Study | Measured | Goal | Status |",
        "|---|---|---|---|",
        *_goal_rows(results, notes, quick),
    ]
    if results.get("bandwidth"):
        lines += ["", "### 1. Bandwidth (median ms; fraction of the bound, higher is better)", ""]
        lines += _bandwidth_table(results["bandwidth"])
    if results.get("leaves"):
        lines += ["", "### 2. Leaf-count scaling (median ms per clip)", ""]
        lines += _leaves_table(results["leaves"])
    if results.get("distributed"):
        lines += ["", "### 3. Distributed, gloo (slowest rank's ms per clip)", ""]
        lines += _distributed_table(results["distributed"])
    if results.get("compile"):
        lines += ["", "### 4. Compile time", ""]
        lines += _compile_table(results["compile"])
    if results.get("gpu"):
        lines += ["", f"### 5. GPU, {results['gpu']['device']} (median ms; fraction of the HBM bound)", ""]
        lines += _bandwidth_table(results["gpu"])
    if results.get("ranks"):
        lines += ["", "### 6. Host time per norm vs world size, fake process group (median ms)", ""]
        lines += _ranks_table(results["ranks"])
    if results.get("features"):
        lines += ["", "### 7. Cost of the features over the plain in-place clip (time ratio, median)", ""]
        lines += _features_table(results["features"])
    if results.get("optimizer"):
        lines += ["", "### 8. The whole optimizer step: time over torch's clip + fused AdamW step (median)", ""]
        lines += _optimizer_table(results["optimizer"])
    if results.get("sweep"):
        lines += [
            "",
            "### 9. Sweep: ours over torch's time, eager and compiled (median; step rows: the whole step)",
            "",
        ]
        lines += _sweep_table(results["sweep"])
    took = ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
    lines += ["", f"Wall time per study: {took}."]
    return "\n".join(lines) + "\n"


def plot_compile(result: dict, path: pathlib.Path) -> None:
    """Compile seconds per implementation and leaf count."""
    import matplotlib.pyplot as plt

    rows = result.get("compile_time", [])
    keys = sorted({(r["leaves"], r["backend"]) for r in rows})
    impls = sorted({r["impl"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        by = {(r["leaves"], r["backend"]): r["compile_s"] for r in rows if r["impl"] == impl}
        xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(keys))]
        ax.bar(xs, [by.get(k, 0.0) for k in keys], width, label=impl)
    ax.set_xticks(range(len(keys)), [f"{n} leaves\n{b}" for n, b in keys])
    ax.set_ylabel("compile seconds (lower is better)")
    ax.set_title("torch.compile(fullgraph=True) of the clip")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def plot_ms(result: dict, path: pathlib.Path) -> None:
    """A bar chart of a study's ``ms`` dict (for studies without a plot of their own)."""
    import matplotlib.pyplot as plt

    ms = result.get("ms", {})
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(ms)), list(ms.values()))
    ax.set_xticks(range(len(ms)), [k.replace("_", "\n") for k in ms], fontsize=8)
    ax.set_ylabel("median ms (lower is better)")
    ax.set_title(f"{result.get('study', '')} study")
    save_figure(fig, path)


def save_figure(fig, path: pathlib.Path) -> None:
    """Lays out ``fig``, writes it to ``path`` as a PNG and closes it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def quick_cli(doc: str | None, run: Callable[..., dict]) -> dict:
    """Runs a study from its own command line (``python -m bench.<name>_study [--quick] [--out DIR]``);
    returns its result."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="results folder (default bench/results)")
    args = parser.parse_args()
    return run(quick=args.quick, out=args.out)
