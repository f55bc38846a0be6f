"""Study 8, one process: the whole optimizer step, clip included, and what a skipped step costs.

Users feel the clip and the optimizer step together; their floor is the
step alone plus one read of the gradients (the norm). Variants, interleaved
(``bench/_timing.py``), each one complete clip + step on the same parameters
and one ``torch.optim.AdamW(fused=True)`` (torchtitan's default
implementation):

* ``step_only``: ``opt.step()``, no clip: the floor without the norm;
* ``torch``: ``torch.nn.utils.clip_grad_norm_(foreach=True)``, then the step;
* ``ours_inplace``: ``ppclip_func.clip_grad_norm_``, then the step;
* ``handed``: ``clip_grad_norm_in_optimizer``, then the step (the clip
  applied by the fused kernel as it reads the gradients);
* ``handed_adaptive``: ``adaptive_clip_grad_norm_in_optimizer`` (ZClip's
  threshold, past its warm-up, and a skip decision), then the step;
* ``handed_skipped``: ``clip_grad_norm_in_optimizer`` with a non-finite norm and
  ``nonfinite="skip"``: the fused kernel skips the step;
* ``skip_update``: ``clip_grad_norm_`` then the step inside
  ``skip_update_(skip, params + AdamW state, ...)``, the undo-based skip of
  0.2 (a copy of every parameter and moment), skipping;
* ``scaled_step_only``: the step as a hand-over runs it, with no norm: the
  fused kernel given a ``grad_scale`` of 1 (on CPU it writes each gradient
  back into ``.grad`` as it reads it, as ``GradScaler`` needs);
* what the floor is made of, no step: ``norm_only``, our norm alone
  (``global_grad_norm``, what the handed clip adds to the step);
  ``torch_norm_only``, torch's (``torch.nn.utils.get_total_norm``,
  foreach); ``read_only``, one read of as many elements of the gradients'
  dtype (``flat.sum()`` over one flat buffer, the read of the bandwidth
  study's bound). ``eager_ratio_vs_step`` puts every variant over
  ``step_only``: the handed step's floor there is ``1 + read_only``.

Bytes allocated during one call of each skipping variant, and of the norm
alone (``norm_only``: what the statistics take), are read with
``torch.profiler`` (``profile_memory=True``). Compiled (inductor,
``fullgraph``; GPT-2 shapes): torch's functional ``adamw(foreach=True,
capturable=True)`` with torch's clip vs ours, and ours with
``skip_update_`` (fused optimizers do not trace: ``torch.compiler.disable``);
fp32 only in the full run (each inductor compile takes minutes here).

Settings: GPT-2 shapes (the bandwidth study's, 148 leaves, 203.7 M elements;
``--quick``: a small GPT-2) and 1000 leaves of 4096 elements, fp32 and bf16.

    python -m bench.optimizer_study [--quick]
"""

from __future__ import annotations

import json
import pathlib

import torch
from torch.optim.adamw import adamw

from bench import _report
from bench._shapes import gpt_shapes, make_grads, make_params, numel
from bench._timing import interleaved, machine
from ppclip_func import (
    adaptive_clip_grad_norm_in_optimizer,
    clip_grad_norm_,
    clip_grad_norm_in_optimizer,
    global_grad_norm,
    init_clip_state,
    skip_update_,
)

NAME = "optimizer"
RESULTS = pathlib.Path(__file__).parent / "results"
FULL = {
    "gpt": {"dim": 1024, "layers": 12, "vocab": 50257, "context": 1024},
    "leaves": [1000],
    "dtypes": ["float32", "bfloat16"],
    # Inductor compiles of the three compiled variants at GPT-2 shapes take minutes each on 2 cores:
    # fp32 only in the full run (the quick run compiles both, with aot_eager).
    "compiled_dtypes": ["float32"],
    "runs": 9,
    "backend": "inductor",
}
QUICK = {
    "gpt": {"dim": 64, "layers": 2, "vocab": 2048, "context": 256},
    "leaves": [100],
    "dtypes": ["float32", "bfloat16"],
    "runs": 5,
    "backend": "aot_eager",
}
LEAF = 4096
EAGER = ("step_only", "torch", "ours_inplace", "handed", "handed_adaptive", "handed_skipped", "skip_update")
# Parts of a step, timed with the variants (no step in them): the norms alone and one read of the gradients.
PARTS = ("scaled_step_only", "norm_only", "torch_norm_only", "read_only")
COMPILED = ("torch", "ours", "ours_skip_update")


def _adamw_state(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)]


def _eager_variants(params: list[torch.nn.Parameter]) -> tuple[dict, dict]:
    """The eager variants, and the skipping ones again for the memory profile."""
    # lr tiny and no decay: the parameters barely move over the rounds; the kernels run all the same.
    opt = torch.optim.AdamW(params, lr=1e-12, weight_decay=0.0, fused=True)
    opt.step()  # the moments exist from here on, as in training
    # A leaf the optimizer does not hold, measured with the model: inf makes the norm non-finite.
    spike = make_params([torch.full((1,), float("inf"))])
    state = _adamw_state(opt, params)
    skip = torch.tensor(True)
    # Past warm-up, with statistics that neither clip nor skip this model's norm (its threshold is computed all the same).
    clip_state = init_clip_state()._replace(count=torch.tensor(100), mean=torch.tensor(1e6, dtype=torch.float64))

    grads = [p.grad for p in params]
    flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype).uniform_(-1.0, 1.0)

    def scaled_step() -> None:
        # The fused step as a hand-over runs it, with no norm: a grad_scale of 1 and a clear found_inf.
        opt.grad_scale, opt.found_inf = torch.ones(()), torch.zeros(())
        try:
            opt.step()
        finally:
            del opt.grad_scale, opt.found_inf

    def ours_then_skippable_step() -> None:
        clip_grad_norm_(params, None, 1.0)
        skip_update_(skip, [*params, *state], opt.step)

    fns = {
        "step_only": opt.step,
        "torch": lambda: (torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True), opt.step()),
        "ours_inplace": lambda: (clip_grad_norm_(params, None, 1.0), opt.step()),
        "handed": lambda: (clip_grad_norm_in_optimizer(opt, params, None, 1.0), opt.step()),
        "handed_adaptive": lambda: (
            adaptive_clip_grad_norm_in_optimizer(opt, params, None, clip_state, max_norm=None, skip_z=6.0),
            opt.step(),
        ),
        "handed_skipped": lambda: (
            clip_grad_norm_in_optimizer(opt, params + spike, None, 1.0, nonfinite="skip"),
            opt.step(),
        ),
        "skip_update": ours_then_skippable_step,
        "scaled_step_only": scaled_step,
        "norm_only": lambda: global_grad_norm(grads, None),
        "torch_norm_only": lambda: torch.nn.utils.get_total_norm(grads, 2.0, foreach=True),
        "read_only": flat.sum,
    }
    profiled = {k: fns[k] for k in ("handed", "handed_skipped", "skip_update", "norm_only")}
    return fns, profiled


def _bytes_allocated(fn) -> int:
    """Bytes allocated (CPU) during one call of ``fn``, by torch.profiler's memory events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return int(sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0))


def _compiled_variants(params: list[torch.nn.Parameter], backend: str) -> dict:
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), dtype=torch.float64) for _ in params]  # capturable: tensors, float64 (demo/optim.py)
    skip = torch.tensor(False)

    def adamw_step() -> None:
        adamw(
            params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps, foreach=True, capturable=True,
            amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-12, weight_decay=0.0, eps=1e-8, maximize=False,
        )  # fmt: skip

    @torch.no_grad()
    def torch_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        adamw_step()

    @torch.no_grad()
    def ours_step() -> None:
        clip_grad_norm_(params, None, 1.0)
        adamw_step()

    @torch.no_grad()
    def ours_skip_update() -> None:
        clip_grad_norm_(params, None, 1.0)
        skip_update_(skip, [*params, *exp_avgs, *exp_avg_sqs, *steps], adamw_step)

    fns = {"torch": torch_step, "ours": ours_step, "ours_skip_update": ours_skip_update}
    return {k: torch.compile(f, backend=backend, fullgraph=True) for k, f in fns.items()}


def _setting(name: str, shapes: list[tuple[int, ...]], dtype: torch.dtype, cfg: dict, compiled: bool) -> dict:
    params = make_params(make_grads(shapes, dtype))
    for p in params:
        p.data = torch.zeros_like(p)  # the step writes them
    fns, skipping = _eager_variants(params)
    eager = interleaved(fns, runs=cfg["runs"], warmup=2)
    out = {
        "setting": name,
        "dtype": str(dtype).removeprefix("torch."),
        "leaves": len(shapes),
        "elements": numel(shapes),
        "eager_ms": eager.all_ms(),
        "eager_ratio_vs_torch": {v: eager.ratio(v, "torch") for v in EAGER},
        "eager_ratio_vs_handed": {v: eager.ratio(v, "handed") for v in EAGER},
        "eager_ratio_vs_step": {v: eager.ratio(v, "step_only") for v in (*EAGER, *PARTS)},
        "bytes_allocated": {k: _bytes_allocated(f) for k, f in skipping.items()},
        "grad_bytes": sum(p.numel() * p.element_size() for p in params),
    }
    if compiled:
        comp = interleaved(_compiled_variants(params, cfg["backend"]), runs=cfg["runs"], warmup=2)
        out["compiled_ms"] = comp.all_ms()
        out["compiled_ratio_vs_torch"] = {v: comp.ratio(v, "torch") for v in COMPILED}
        out["compiled_first_call_s"] = dict(comp.first)
    print(f"[bench] optimizer: {name} {out['dtype']}: eager x torch {out['eager_ratio_vs_torch']}", flush=True)
    return out


def run(quick: bool = False, out: pathlib.Path | None = None) -> dict:
    """Measures every setting; writes ``<out>/optimizer.json`` and returns it."""
    cfg = QUICK if quick else FULL
    settings = []
    for dtype_name in cfg["dtypes"]:
        dtype = getattr(torch, dtype_name)
        compiled = dtype_name in cfg.get("compiled_dtypes", cfg["dtypes"])
        settings.append(_setting("gpt2", [s for _, s in gpt_shapes(**cfg["gpt"])], dtype, cfg, compiled=compiled))
        for n in cfg["leaves"]:
            settings.append(_setting(f"{n}_leaves", [(LEAF,)] * n, dtype, cfg, compiled=False))
    result = {"study": NAME, "quick": quick, "machine": machine(), "runs": cfg["runs"], "config": cfg}
    result["settings"] = settings
    out = out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def plot(result: dict, path: pathlib.Path) -> None:
    """Each variant's clip + step time over torch's clip + step, per setting and dtype."""
    import matplotlib.pyplot as plt

    settings = result["settings"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(EAGER)
    for j, v in enumerate(EAGER):
        ys = [s["eager_ratio_vs_torch"][v] for s in settings]
        ax.bar([i + j * width for i in range(len(settings))], ys, width, label=v)
    ax.axhline(1.0, color="gray", lw=0.8)
    labels = [f"{s['setting']}\n{s['dtype']}" for s in settings]
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(settings))], labels)
    ax.set_ylabel("time / torch clip + fused AdamW step")
    ax.set_title("Whole optimizer step, eager (lower is better)", fontsize=10)
    ax.legend(fontsize=7)
    _report.save_figure(fig, path)


def main() -> None:
    r = _report.quick_cli(__doc__, run)
    for s in r["settings"]:
        keep = {k: v for k, v in s.items() if "ratio" in k or k == "bytes_allocated"}
        print(s["setting"], s["dtype"], json.dumps(keep, indent=1))


if __name__ == "__main__":
    main()
