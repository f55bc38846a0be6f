"""What writing the step's state back in place costs, compiled: ``write_back_`` against the alternatives.

A compiled optimizer step whose state lives in persistent tensors (a step
captured in a CUDA graph, or any compiled step that keeps its state where
it is) must end by writing the new state into them. One process, CPU
inductor, ``fullgraph=True``; each variant is the same step (the pure
adaptive clip of the given gradients, torch's functional AdamW on clones,
``select_update`` against a skip) and differs only in where the new state
goes:

* ``returned``: the step returns its new parameters, moments, step counts
  and clip state, which the caller holds for the next call: nothing is
  written in place (the floor; a CUDA graph could not keep them);
* ``write_back``: the step ends with ``write_back_(persistent, new)``
  and returns nothing (docs/cuda-graphs.md's recipe): the package's op,
  one copy of the state after the kernels that compute it;
* ``copied_after``: the pure step compiled, its results copied into the
  persistent tensors by an eager ``torch._foreach_copy_`` after each call
  (right, but outside the graph that a capture would hold);
* ``in_place``: the step written in place instead: AdamW updates the
  persistent tensors themselves inside ``skip_update_``, the clip state is
  written by ``write_back_`` (as ``ClipStateful.update_`` writes it).

A hand-written ``_foreach_copy_`` inside the graph is not timed: it is
wrong (``tests/test_write_back.py``).

    python -m bench.write_back_study           # 16 leaves of 1 M fp32 elements
    python -m bench.write_back_study --quick   # 4 leaves of 64 K

Writes ``bench/results/write_back.json``: milliseconds per step and each
variant over ``returned``, the first call (compile) of each, and how far
each variant's final state is from ``returned``'s (they ran the same
steps).
"""

from __future__ import annotations

import pathlib

import torch
from torch.optim.adamw import adamw
from torch.utils import _pytree as pytree

from bench._report import quick_cli, write_result
from bench._timing import interleaved, machine
from ppclip_func import adaptive_clip_grad_norm, init_clip_state, select_update, skip_update_, write_back_

NAME = "write_back"
FULL = {"leaves": 16, "size": 1 << 20, "runs": 15}
QUICK = {"leaves": 4, "size": 1 << 16, "runs": 5}


def _state(leaves: int, size: int, seed: int = 0) -> tuple[dict, dict]:
    """Parameters, AdamW moments and step counts, the clip state; and the gradients."""
    gen = torch.Generator().manual_seed(seed)
    params = {f"w{i}": torch.randn(size, generator=gen) for i in range(leaves)}
    grads = {n: torch.randn(size, generator=gen) for n in params}
    state = {
        "params": params,
        "exp_avg": {n: torch.zeros(size) for n in params},
        "exp_avg_sq": {n: torch.zeros(size) for n in params},
        "step": {n: torch.zeros((), dtype=torch.float64) for n in params},
        "clip": init_clip_state(),
    }
    return state, grads


def _step(state: dict, grads: dict) -> dict:
    """One optimizer step, pure: the new state (the old one where the clip skips)."""
    clipped, stats = adaptive_clip_grad_norm(grads, None, state["clip"], max_norm=1.0, warmup=2)
    new = {k: {n: t.clone() for n, t in state[k].items()} for k in ("params", "exp_avg", "exp_avg_sq", "step")}
    adamw(
        list(new["params"].values()), list(clipped.values()), list(new["exp_avg"].values()),
        list(new["exp_avg_sq"].values()), [], list(new["step"].values()), foreach=True, capturable=True,
        amsgrad=False, maximize=False, beta1=0.9, beta2=0.95, lr=1e-4, weight_decay=0.1, eps=1e-8,
    )  # fmt: skip
    kept = select_update(stats.skip, new, {k: state[k] for k in new})
    return {**kept, "clip": stats.state}


def _step_in_place(state: dict, grads: dict) -> None:
    """The same step, every tensor of ``state`` updated in place."""
    clipped, stats = adaptive_clip_grad_norm(grads, None, state["clip"], max_norm=1.0, warmup=2)
    lists = [list(state[k].values()) for k in ("params", "exp_avg", "exp_avg_sq", "step")]

    def update() -> None:
        adamw(
            lists[0], list(clipped.values()), lists[1], lists[2], [], lists[3], foreach=True, capturable=True,
            amsgrad=False, maximize=False, beta1=0.9, beta2=0.95, lr=1e-4, weight_decay=0.1, eps=1e-8,
        )  # fmt: skip

    skip_update_(stats.skip, lists, update)
    write_back_(state["clip"], stats.state)


def _variants(leaves: int, size: int) -> tuple[dict, dict]:
    held, grads = _state(leaves, size)
    persistent, _ = _state(leaves, size)
    after, _ = _state(leaves, size)
    in_place_state, _ = _state(leaves, size)
    pure = torch.compile(_step, fullgraph=True)

    def returned() -> None:
        held.update(pure(held, grads))

    @torch.compile(fullgraph=True)
    def write_back() -> None:
        write_back_(persistent, _step(persistent, grads))

    pure_after = torch.compile(_step, fullgraph=True)

    def copied_after() -> None:
        new = pure_after(after, grads)
        with torch.no_grad():
            torch._foreach_copy_(pytree.tree_leaves(after), pytree.tree_leaves(new))

    @torch.compile(fullgraph=True)
    def in_place() -> None:
        _step_in_place(in_place_state, grads)

    fns = {"returned": returned, "write_back": write_back, "copied_after": copied_after, "in_place": in_place}
    return fns, {"returned": held, "write_back": persistent, "copied_after": after, "in_place": in_place_state}


def _max_rel_diff(a: dict, b: dict) -> float:
    """The largest difference between two states' tensors, relative to each tensor's largest value."""
    worst = 0.0
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)):
        x, y = x.double(), y.double()
        worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)))
    return worst


def run(quick: bool = False, out: pathlib.Path | None = None) -> dict:
    cfg = QUICK if quick else FULL
    torch._dynamo.reset()
    fns, states = _variants(cfg["leaves"], cfg["size"])
    timings = interleaved(fns, runs=cfg["runs"], warmup=2)
    result = {
        "study": NAME,
        "quick": quick,
        "machine": machine(),
        "config": cfg,
        "state_bytes": 3 * cfg["leaves"] * cfg["size"] * 4,
        "ms": timings.all_ms(),
        "ratio_vs_returned": {v: timings.ratio(v, "returned") for v in fns},
        "first_call_s": dict(timings.first),
        # Every variant ran the same steps from the same state: where they end must agree.
        "max_rel_diff_vs_returned": {v: _max_rel_diff(states[v], states["returned"]) for v in states},
    }
    write_result(result, out)
    print(f"[bench] write_back: x returned {result['ratio_vs_returned']}", flush=True)
    return result


def main() -> None:
    quick_cli(__doc__, run)


if __name__ == "__main__":
    main()
