"""What AdaGC and the per-group clip cost against the plain in-place clip, one process, fp32 grads.

Variants, interleaved in the same run (``bench/_timing.py``):

* ``plain``: ``clip_grad_norm_(params, None, 1.0)``;
* ``param_norms``: ``adaptive_clip_grad_norm_(..., z=None, param_norms=index)``
  returning the per-parameter norms: the measurement AdaGC needs;
* ``adagc``: ``adagc_clip_grad_norm_`` after warm-up (each parameter against
  its own running norm; state not fed back, so every call does the same work);
* ``by_group``: ``clip_grad_norm_by_group_`` with one group excluded and one
  at its own threshold.

Settings: GPT-2 shapes (148 leaves, 203.7 M elements) and 1000 leaves of
4096 elements, eager; compiled (inductor, ``fullgraph``) at GPT-2 shapes
(``--compiled-leaves 1000`` adds the 1000-leaf setting: a few minutes of
compiling per variant). Goals (issue 21): eager <= 1.1x, compiled <= 1.02x
the plain clip.

    python -m bench.adagc_study [--runs 9] [--compiled-leaves 1000] [--out bench/results/adagc.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from bench._shapes import gpt_shapes, make_grads, make_params
from bench._timing import interleaved, machine
from ppclip_func import (
    adagc_clip_grad_norm_,
    adaptive_clip_grad_norm_,
    clip_grad_norm_,
    clip_grad_norm_by_group_,
    init_adagc_state,
    init_clip_state,
    param_norm_index,
)

RESULTS = pathlib.Path(__file__).parent / "results"


def _setting(name: str) -> tuple[dict[str, torch.nn.Parameter], dict[str, str]]:
    if name == "gpt2":
        shapes = gpt_shapes(1024, 12, 50257, 1024)
        groups = {"embed": "tok_embeddings", "head": "output"}
    else:
        shapes = [(f"l{i}", (4096,)) for i in range(int(name.split("_")[0]))]
        groups = {"embed": "l1", "head": "l2"}
    grads = make_grads([s for _, s in shapes], torch.float32)
    return dict(zip([f"{n}.{i}" for i, (n, _) in enumerate(shapes)], make_params(grads))), groups


def _variants(params, groups) -> dict:
    index = param_norm_index(params, None)
    state = adagc_clip_grad_norm_(params, None, init_adagc_state(index), index, warmup=0).state
    clip_state = init_clip_state()
    return {
        "plain": lambda: clip_grad_norm_(params, None, 1.0),
        "param_norms": lambda: (
            adaptive_clip_grad_norm_(params, None, clip_state, z=None, param_norms=index).param_norms
        ),
        "adagc": lambda: adagc_clip_grad_norm_(params, None, state, index, warmup=0).coefficients,
        "by_group": lambda: clip_grad_norm_by_group_(
            params, None, groups, 1.0, group_max_norm={"embed": 0.5}, exclude={"head"}
        )[0],
    }


def _ratios(t) -> dict[str, float]:
    return {name: round(t.ratio(name, "plain"), 3) for name in t.all_ms()}


def run(runs: int, compiled_settings: list[str]) -> dict:
    torch.set_num_threads(1)
    out: dict = {"machine": machine(), "date": time.strftime("%Y-%m-%d", time.gmtime()), "settings": {}}
    for name in ("gpt2", "1000_leaves"):
        params, groups = _setting(name)
        t = interleaved(_variants(params, groups), runs=runs)
        entry = {"eager_ms": {k: round(v, 3) for k, v in t.all_ms().items()}, "eager_ratio_vs_plain": _ratios(t)}
        if name in compiled_settings:
            compiled, first = {}, {}
            for variant, f in _variants(params, groups).items():
                if variant == "param_norms":
                    continue
                compiled[variant] = torch.compile(f, fullgraph=True)
                t0 = time.perf_counter()
                compiled[variant]()
                first[variant] = round(time.perf_counter() - t0, 1)
            t = interleaved(compiled, runs=runs)
            entry |= {
                "compiled_ms": {k: round(v, 3) for k, v in t.all_ms().items()},
                "compiled_ratio_vs_plain": _ratios(t),
                "compiled_first_call_s": first,
            }
        out["settings"][name] = entry
        print(name, json.dumps(entry), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--compiled-leaves", type=int, choices=[1000], help="also compile the 1000-leaf setting")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "adagc.json")
    args = parser.parse_args()
    compiled = ["gpt2"] + ([f"{args.compiled_leaves}_leaves"] if args.compiled_leaves else [])
    result = run(args.runs, compiled)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
