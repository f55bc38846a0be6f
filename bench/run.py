"""Run the benchmark studies: JSON and a PNG plot per study, and a Markdown summary.

    python -m bench                  # full run, results in bench/results/ (long: see README)
    python -m bench --quick          # CI-sized: small sizes, fewer points, distributed eager only
    python -m bench --only bandwidth distributed
    python -m bench --quick --out /tmp/bench   # leave bench/results/ alone

Studies (each a module ``bench/<name>_study.py`` with ``run(quick, out) -> dict``):

1. ``bandwidth``: one process, GPT-2 shapes, fp32/bf16; torch and ours, eager and
   compiled, against the memory-bandwidth bound measured in the same run.
2. ``leaves``: one process, 100 → 10 000 leaves; plain tensors and DTensors.
3. ``distributed``: 4 and 8 gloo ranks, PP × FSDP2 × TP and PP × FSDP2 × EP
   DTensor grads; ours vs torchtitan's own clip (or, without torchtitan, the
   same algorithm written here), time and counted collectives per clip, and
   every norm type against a float64 reference.
4. ``compile``: compile time, ours vs torch's clip (``bench/compile_study.py``).
5. ``gpu``: study 1 on CUDA, bf16 Llama-3-8B shapes (``bench/gpu_study.py``); on a
   machine without CUDA it is recorded as not measured (an earlier measured
   ``gpu.json`` in ``<out>`` is kept).
6. ``ranks``: one process on a fake process group, 64 → 65 536 ranks, 1000
   DTensor leaves: host time per norm, ours vs torch's, and the first call.
7. ``features``: one process: what the adaptive threshold, step skipping and
   per-parameter norms cost over the plain clip, GPT-2 shapes and 1000 and
   10 000 leaves.
8. ``optimizer``: one process: the whole optimizer step (clip + fused AdamW),
   torch's clip vs ours in place vs the clip handed to the optimizer, skipped
   steps (time and bytes allocated), eager and compiled, fp32 and bf16.
9. ``sweep``: one process: torch's clip vs ours, eager and compiled, over
   10 → 1000 leaves of 16 M elements and leaves of 4 K → 1 M elements, fp32
   and bf16, DTensors, the compiled optimizer step, and the ops an
   accelerator's host dispatches per clip.

Also run if present: ``overflow`` (what ``overflow_safe=True`` costs).

Results go to ``<out>/<name>.json`` and ``<out>/<name>.png``; the summary,
with the goals and whether this run met them, to ``<out>/summary.md``. The
exit status is non-zero if a study raised.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import pathlib
import sys
import time
import traceback

import torch

from bench import _report

RESULTS = pathlib.Path(__file__).parent / "results"
STUDIES = (
    "bandwidth",
    "leaves",
    "distributed",
    "ranks",
    "compile",
    "overflow",
    "features",
    "optimizer",
    "sweep",
    "gpu",
)
OPTIONAL = {"compile", "overflow"}  # written elsewhere; skipped with a note if absent
COMPILE_LEAVES_FULL = [145, 1000]


def _run_study(name: str, quick: bool, out: pathlib.Path) -> dict:
    mod = importlib.import_module(f"bench.{name}_study")
    params = inspect.signature(mod.run).parameters
    kwargs: dict = {"quick": quick}
    if "leaves" in params and not quick:
        kwargs["leaves"] = COMPILE_LEAVES_FULL
    if "out" in params:
        kwargs["out"] = out
    elif hasattr(mod, "RESULTS"):
        mod.RESULTS = out  # a study that writes to its module's RESULTS folder
    result = mod.run(**kwargs)
    _report.write_result(result, out)
    return result


def _plot(name: str, result: dict, out: pathlib.Path) -> str | None:
    """Writes ``<out>/<name>.png``; returns why not if it could not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    mod = importlib.import_module(f"bench.{name}_study")
    if hasattr(mod, "plot"):
        plot = mod.plot
    elif name == "compile":
        plot = _report.plot_compile
    else:
        plot = _report.plot_ms
    plot(result, out / f"{name}.png")
    return None


def _gpu_not_measured(out: pathlib.Path) -> str:
    """Records that this machine has no GPU, keeping a measured ``gpu.json`` from elsewhere."""
    path = out / "gpu.json"
    if path.exists() and json.loads(path.read_text()).get("measured"):
        return f"not measured in this run (no CUDA); {path.name} keeps an earlier GPU run"
    reason = "no GPU on this machine (torch.cuda.is_available() is False)"
    _report.write_result({"study": "gpu", "measured": False, "reason": reason}, out)
    return reason


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized run")
    parser.add_argument("--only", nargs="+", choices=STUDIES, help="run these studies only")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="results folder (default bench/results)")
    parser.add_argument(
        "--summarize",
        action="store_true",
        help="run nothing: rebuild <out>/summary.md from the study JSONs already there (after --only runs)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        found = {
            name: json.loads((args.out / f"{name}.json").read_text())
            for name in STUDIES
            if (args.out / f"{name}.json").exists()
        }
        if not found.get("gpu", {}).get("measured"):  # a GPU run's gpu.json (from a GPU machine) is kept
            found.pop("gpu", None)
        notes = {} if "gpu" in found else {"gpu": _gpu_not_measured(args.out)}
        summary = _report.summary(found, notes, False, {})
        (args.out / "summary.md").write_text(summary)
        print(summary)
        return 0

    results: dict[str, dict | None] = {}
    notes: dict[str, str] = {}
    seconds: dict[str, float] = {}
    failed = []
    for name in args.only or STUDIES:
        if name == "gpu" and not torch.cuda.is_available():
            notes[name] = _gpu_not_measured(args.out)
            print(f"[bench] gpu: {notes[name]}", flush=True)
            continue
        if name in OPTIONAL and importlib.util.find_spec(f"bench.{name}_study") is None:
            notes[name] = f"not run: bench/{name}_study.py is absent"
            print(f"[bench] {name}: {notes[name]}", flush=True)
            continue
        print(f"[bench] {name}{' (quick)' if args.quick else ''} ...", flush=True)
        t0 = time.perf_counter()
        try:
            results[name] = _run_study(name, args.quick, args.out)
        except Exception:
            traceback.print_exc()
            notes[name] = "failed: see the log"
            failed.append(name)
            continue
        finally:
            seconds[name] = time.perf_counter() - t0
            torch._dynamo.reset()
        why = _plot(name, results[name], args.out)
        if why:
            print(f"[bench] {name}: no plot, {why}", flush=True)
        print(f"[bench] {name}: {seconds[name]:.0f} s", flush=True)

    summary = _report.summary(results, notes, args.quick, seconds)
    (args.out / "summary.md").write_text(summary)
    print(summary)
    if failed:
        print(f"[bench] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
