"""What recording the clip's statistics costs: the adaptive clip with every parameter's norm, with and without a recorder.

One process, fp32 grads, the variants interleaved (``bench/_timing.py``):

* ``clip``: ``adaptive_clip_grad_norm_(params, None, state, param_norms=index)``
  after its warm-up, the state carried on: the clip whose statistics a run
  records;
* ``clip_record``: the same, then ``recorder.record(stats)`` in the step (a
  row into the device ring, the per-parameter statistics updated): what a
  step pays;
* ``clip_record_read``: the same, then ``recorder.flush()`` and
  ``recorder.read()`` after every step (a logger that reads each step; on a
  CPU no copy is needed, so this is the host's decoding of one record).

Eager at the bandwidth study's GPT-2 shapes (148 leaves, 203.7 M elements)
and 1000 leaves of 4096 elements; compiled (inductor, ``fullgraph``; the
step without the read, which runs outside it) at 100 leaves of 65 536.
``--quick``: a small GPT-2, 100 leaves of 4096, and compiled at 16 leaves.
No collective is involved (``mesh=None``): the recorder issues none, and
the clip's own is the same with or without it.

    python -m bench.record_study [--quick]

Writes ``bench/results/record.json``: milliseconds per call and each
variant over ``clip``.
"""

from __future__ import annotations

import pathlib

import torch

from bench._report import quick_cli, write_result
from bench._shapes import gpt_shapes, make_grads, make_params, numel
from bench._timing import interleaved, machine
from ppclip_func import ClipRecorder, adaptive_clip_grad_norm_, init_clip_state, param_norm_index

NAME = "record"
FULL = {
    "gpt": {"dim": 768, "layers": 12, "vocab": 50257, "context": 1024},
    "eager_leaves": [(1000, 4096)],
    "compiled_leaves": [(100, 65536)],
    "runs": 15,
}
QUICK = {
    "gpt": {"dim": 64, "layers": 2, "vocab": 512, "context": 64},
    "eager_leaves": [(100, 4096)],
    "compiled_leaves": [(16, 4096)],
    "runs": 5,
}
CLIP = {"max_norm": 1e9, "warmup": 3}  # past its warm-up after the first rounds; never clips (the same work)


def _variants(shapes: list[tuple[int, ...]], compiled: bool) -> dict:
    params = make_params(make_grads(shapes, torch.float32))
    named = {f"p{i}": p for i, p in enumerate(params)}
    index = param_norm_index(named, None)
    recorder = ClipRecorder(index, capacity=64)
    states = {k: [init_clip_state()] for k in ("clip", "clip_record", "clip_record_read")}

    def clip() -> None:
        stats = adaptive_clip_grad_norm_(named, None, states["clip"][0], param_norms=index, **CLIP)
        states["clip"][0] = stats.state

    def clip_record() -> None:
        stats = adaptive_clip_grad_norm_(named, None, states["clip_record"][0], param_norms=index, **CLIP)
        states["clip_record"][0] = stats.state
        recorder.record(stats)

    if compiled:
        return {"clip": torch.compile(clip, fullgraph=True), "clip_record": torch.compile(clip_record, fullgraph=True)}

    def clip_record_read() -> None:
        stats = adaptive_clip_grad_norm_(named, None, states["clip_record_read"][0], param_norms=index, **CLIP)
        states["clip_record_read"][0] = stats.state
        recorder.record(stats)
        recorder.flush()
        recorder.read()

    return {"clip": clip, "clip_record": clip_record, "clip_record_read": clip_record_read}


def _setting(name: str, shapes: list[tuple[int, ...]], compiled: bool, runs: int) -> dict:
    torch._dynamo.reset()
    fns = _variants(shapes, compiled)
    t = interleaved(fns, runs=runs, warmup=4)
    out = {
        "setting": name,
        "mode": "compiled" if compiled else "eager",
        "leaves": len(shapes),
        "elements": numel(shapes),
        "ms": t.all_ms(),
        "ratio_vs_clip": {v: t.ratio(v, "clip") for v in fns},
    }
    print(f"[bench] record: {name} {out['mode']}: x clip {out['ratio_vs_clip']}", flush=True)
    return out


def run(quick: bool = False, out: pathlib.Path | None = None) -> dict:
    cfg = QUICK if quick else FULL
    settings = [_setting("gpt2", [s for _, s in gpt_shapes(**cfg["gpt"])], False, cfg["runs"])]
    settings += [_setting(f"{n}x{size}", [(size,)] * n, False, cfg["runs"]) for n, size in cfg["eager_leaves"]]
    settings += [_setting(f"{n}x{size}", [(size,)] * n, True, cfg["runs"]) for n, size in cfg["compiled_leaves"]]
    result = {"study": NAME, "quick": quick, "machine": machine(), "config": cfg, "settings": settings}
    write_result(result, out)
    return result


def main() -> None:
    quick_cli(__doc__, run)


if __name__ == "__main__":
    main()
