"""Study 7, one process: what the adaptive threshold, step skipping and per-parameter norms cost.

Each feature against the plain in-place clip it extends, in the same run,
interleaved (``bench/_timing.py``), fp32 grads:

* ``plain``: ``clip_grad_norm_(params, None, 1.0)``;
* ``adaptive``: ``adaptive_clip_grad_norm_`` after warm-up (threshold from
  the running statistics, state updated): a few 0-dim ops more;
* ``adaptive_skip``: the same with ``skip_z`` set: the skip decision;
* ``param_norms``: ``adaptive_clip_grad_norm_(..., param_norms=index)``: one
  statistic per leaf, kept apart, and ``N`` more entries in the collective;

and, for skipping, the optimizer step it wraps: torch's functional AdamW
(``adamw_step``) against ``skip_update_(skip, params + state, adamw_step)``
(``adamw_skippable``: a copy of parameters and state, and a select), eager
and (GPT-2 shapes) compiled.

Settings: the bandwidth study's GPT-2 shapes (148 leaves, 203.7 M elements;
``--quick``: a small GPT-2), and 1000 and 10 000 leaves of 4096 elements.
Eager everywhere; compiled (inductor, ``fullgraph``) in the GPT-2 setting
and, for the plain clip, the skip decision and per-parameter norms, at 1000
leaves (an inductor compile of a 1000-leaf clip takes about 150 s here per
variant: study 4); not at 10 000 leaves, where it would take hours.

    python -m bench.features_study [--quick]
    python -m bench.features_study --compiled-leaves-only 1000   # add them to an existing features.json
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
from torch.optim.adamw import adamw

from bench import _report
from bench._shapes import gpt_shapes, make_grads, make_params, numel
from bench._timing import interleaved, machine
from ppclip_func import adaptive_clip_grad_norm_, clip_grad_norm_, init_clip_state, param_norm_index, skip_update_

NAME = "features"
RESULTS = pathlib.Path(__file__).parent / "results"
FULL = {
    "gpt": {"dim": 1024, "layers": 12, "vocab": 50257, "context": 1024},
    "leaves": [1000, 10000],
    "runs": 9,
    "backend": "inductor",
    # Compiled at 1000 leaves too (an inductor compile of a 1000-leaf clip takes ~150 s here, per
    # variant: three variants, not four). 10 000 leaves compiled would take hours: not measured.
    "compiled_leaves": [1000],
}
QUICK = {
    "gpt": {"dim": 64, "layers": 2, "vocab": 2048, "context": 256},
    "leaves": [100],
    "runs": 5,
    "backend": "aot_eager",
}
LEAF = 4096
CLIP_VARIANTS = ("plain", "adaptive", "adaptive_skip", "param_norms")


def _warm_state():
    """A state past its warm-up, so the adaptive branch is the one measured (the graph is the same either way)."""
    return init_clip_state()._replace(count=torch.tensor(100), mean=torch.tensor(1e3), var=torch.tensor(1e4))


def _clip_variants(named: dict[str, torch.nn.Parameter], backend: str | None) -> dict:
    params = list(named.values())
    index = param_norm_index(named, None)
    state = _warm_state()
    fns = {
        "plain": lambda: clip_grad_norm_(params, None, 1.0),
        "adaptive": lambda: adaptive_clip_grad_norm_(params, None, state).threshold,
        "adaptive_skip": lambda: adaptive_clip_grad_norm_(params, None, state, skip_z=6.0).skip,
        "param_norms": lambda: adaptive_clip_grad_norm_(named, None, state, param_norms=index).param_norms,
    }
    if backend is not None:
        fns = {k: torch.compile(f, backend=backend, fullgraph=True) for k, f in fns.items()}
    return fns


def _optimizer_variants(params: list[torch.nn.Parameter], backend: str | None) -> dict:
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    # Compiled, AdamW runs capturable (step counts stay tensors); float64 counts, as demo/optim.py explains.
    steps = [torch.zeros((), dtype=torch.float64) for _ in params]
    skip = torch.tensor(False)

    def adamw_step() -> None:
        with torch.no_grad():
            adamw(
                params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps, foreach=True, amsgrad=False,
                beta1=0.9, beta2=0.95, lr=1e-12, weight_decay=0.0, eps=1e-8, maximize=False,
                capturable=torch.compiler.is_compiling(),
            )  # fmt: skip

    def adamw_skippable() -> None:
        skip_update_(skip, [*params, *exp_avgs, *exp_avg_sqs, *steps], adamw_step)

    fns = {"adamw_step": adamw_step, "adamw_skippable": adamw_skippable}
    if backend is not None:
        fns = {k: torch.compile(f, backend=backend, fullgraph=True) for k, f in fns.items()}
    return fns


COMPILED_AT_SCALE = ("plain", "adaptive_skip", "param_norms")


def _compiled_at_scale(setting: dict, n: int, runs: int, backend: str) -> None:
    """Adds the compiled clip variants (those of ``COMPILED_AT_SCALE``) to a leaf-count setting."""
    named = dict(zip((f"layers.{i}.w" for i in range(n)), make_params(make_grads([(LEAF,)] * n, torch.float32))))
    fns = {k: f for k, f in _clip_variants(named, backend).items() if k in COMPILED_AT_SCALE}
    comp = interleaved(fns, runs=runs, warmup=2)
    setting["compiled_ms"] = comp.all_ms()
    setting["compiled_ratio_vs_plain"] = {v: comp.ratio(v, "plain") for v in COMPILED_AT_SCALE}
    setting["compiled_first_call_s"] = dict(comp.first)
    print(f"[bench] features: {n} leaves compiled x plain {setting['compiled_ratio_vs_plain']}", flush=True)


def _setting(name: str, shapes: list[tuple[str, tuple[int, ...]]], runs: int, backend: str | None) -> dict:
    grads = make_grads([s for _, s in shapes], torch.float32)
    params = make_params(grads)
    for p in params:
        p.data = torch.zeros_like(p)  # the optimizer step writes them
    named = dict(zip((n for n, _ in shapes), params))
    # Each clip scales the grads by at most 1; the values shrink over the rounds but stay far from 0 in fp32.
    eager = interleaved(_clip_variants(named, None), runs=runs, warmup=2)
    out = {
        "setting": name,
        "leaves": len(shapes),
        "elements": numel([s for _, s in shapes]),
        "eager_ms": eager.all_ms(),
        "eager_ratio_vs_plain": {v: eager.ratio(v, "plain") for v in CLIP_VARIANTS},
    }
    if backend is not None:
        comp = interleaved(_clip_variants(named, backend), runs=runs, warmup=2)
        out["compiled_ms"] = comp.all_ms()
        out["compiled_ratio_vs_plain"] = {v: comp.ratio(v, "plain") for v in CLIP_VARIANTS}
        out["compiled_first_call_s"] = {k: v for k, v in comp.first.items()}
    opt = interleaved(_optimizer_variants(params, None), runs=runs, warmup=1)
    out["optimizer_ms"] = opt.all_ms()
    out["skippable_over_adamw"] = opt.ratio("adamw_skippable", "adamw_step")
    if backend is not None:
        opt = interleaved(_optimizer_variants(params, backend), runs=runs, warmup=1)
        out["optimizer_compiled_ms"] = opt.all_ms()
        out["skippable_over_adamw_compiled"] = opt.ratio("adamw_skippable", "adamw_step")
    print(f"[bench] features: {name}: eager x plain {out['eager_ratio_vs_plain']}", flush=True)
    return out


def run(quick: bool = False, out: pathlib.Path | None = None) -> dict:
    """Measures every setting; writes ``<out>/features.json`` and returns it."""
    cfg = QUICK if quick else FULL
    settings = [_setting("gpt2", gpt_shapes(**cfg["gpt"]), cfg["runs"], cfg["backend"])]
    for n in cfg["leaves"]:
        shapes = [(f"layers.{i}.w", (LEAF,)) for i in range(n)]
        settings.append(_setting(f"{n}_leaves", shapes, cfg["runs"], None))
        if n in cfg.get("compiled_leaves", ()):
            _compiled_at_scale(settings[-1], n, cfg["runs"], cfg["backend"])
    result = {
        "study": NAME,
        "quick": quick,
        "machine": machine(),
        "runs": cfg["runs"],
        "config": cfg,
        "settings": settings,
    }
    out = out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def plot(result: dict, path: pathlib.Path) -> None:
    """Each feature's time over the plain clip's, per setting, eager and compiled."""
    import matplotlib.pyplot as plt

    settings = result["settings"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / len(CLIP_VARIANTS[1:]) / 2
    for j, v in enumerate(CLIP_VARIANTS[1:]):
        for k, mode in enumerate(("eager", "compiled")):
            have = [
                (i, s[f"{mode}_ratio_vs_plain"][v])
                for i, s in enumerate(settings)
                if v in s.get(f"{mode}_ratio_vs_plain", {})
            ]
            xs = [i + (2 * j + k) * width for i, _ in have]
            ys = [y for _, y in have]
            ax.bar(xs, ys, width, label=f"{v} ({mode})", alpha=1.0 if mode == "eager" else 0.55)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(settings))], [s["setting"] for s in settings])
    ax.set_ylabel("time / plain clip's (lower is better)")
    ax.set_title("Cost of each feature over the plain in-place clip (fp32)", fontsize=10)
    ax.legend(fontsize=7)
    _report.save_figure(fig, path)


def compiled_at_scale_only(n: int, out: pathlib.Path | None = None) -> dict:
    """Adds the compiled variants at ``n`` leaves to an existing ``features.json`` (after a run without them)."""
    out = out or RESULTS
    result = json.loads((out / f"{NAME}.json").read_text())
    setting = next(s for s in result["settings"] if s["setting"] == f"{n}_leaves")
    _compiled_at_scale(setting, n, FULL["runs"], FULL["backend"])
    result["config"]["compiled_leaves"] = sorted({*result["config"].get("compiled_leaves", []), n})
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--compiled-leaves-only":
        compiled_at_scale_only(int(sys.argv[2]))
        return
    r = _report.quick_cli(__doc__, run)
    for s in r["settings"]:
        print(s["setting"], json.dumps({k: v for k, v in s.items() if "ratio" in k or "over" in k}, indent=1))


if __name__ == "__main__":
    main()
