"""What the ranks-agree checks cost in the steady state (issue 26): the clip with each check and without.

* **Options** (``_core.agreement.check_call``): a call that repeats the last
  configuration verified on its group is one comparison on the host; a
  configuration met before but not last, a comparison with the ones seen.
  Measured on the eager in-place clip of many small leaves, where host work
  weighs most: ``clip_grad_norm_`` with and without ``groups``, and the
  adaptive clip with ``param_norms=`` (a ``ParamIndex`` of every leaf).
* **Adaptive state** (``_core.agreement.state_entries``/``states_agree``): four more
  float64 entries in the one all-reduce, a fingerprint of the state's bits
  (eagerly on the CPU computed on the host from the state's values, and the
  decision read there; traced, tensor ops and one ``torch._assert_async``).
  Measured eager and compiled (inductor).

"Without" switches the checks off in the library (no options comparison,
nor the options the public functions make for it; ``carries_state`` false,
so no entries and no assert), in the same process, interleaved round by
round with "with" in a seeded random order (``bench/_timing.interleaved``),
and run a second time in each round as an A/A control: the spread of
without/without is what a with/without ratio can resolve. The smallest
adaptive clip also runs "without" plus a known amount of busy work
(:data:`KNOWN_US`): what the timing reads for it. Two gloo ranks (a
one-rank world has no collective, so no state check), each pinned to a core
of its own where there are enough, one torch thread each, a barrier before
each timed call. The checks are also timed by themselves, the state check
interleaved with the smallest adaptive clip (its share of that clip), and
each of their pieces inside that clip (:func:`in_place`: where each runs
cold, after the gradients' pass).

Run: ``python -m bench.agree_cost`` (``--quick`` for a short run). Writes
``bench/results/agree_cost.json``. With ``--device cuda`` both ranks share
the one GPU (gloo moves CUDA tensors; NCCL wants a GPU per rank), each call
is waited for on the device, and ``agree_cost_cuda.json`` is written.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pathlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import ppclip_func._core.measure as measure_module
from bench._dist import single_rank_group, spawn
from bench._shapes import gpt_shapes, make_grads, make_params, numel
from bench._timing import interleaved, machine
from ppclip_func import (
    adaptive_clip_grad_norm,
    adaptive_clip_grad_norm_,
    clip_grad_norm_,
    init_clip_state,
    param_norm_index,
)
from ppclip_func._core.norms import norm_kind

RESULTS = pathlib.Path(__file__).parent / "results" / "agree_cost.json"


# The modules whose public functions build their callers' options for the check (``_core.agreement.agreed``).
_CALLERS = tuple(
    importlib.import_module(f"ppclip_func._clip.{name}") for name in ("forms", "adagc", "per_group", "optimizer")
)


@contextlib.contextmanager
def checks_off():
    """The library with neither check: no options comparison (nor the options ``agreed()`` makes for it),
    no state fingerprint, no state entries in the all-reduce. (The adaptive functions pass theirs as a
    tuple of their arguments, built in both variants: ~0.3 us a call.)"""
    patched = [
        (measure_module, "check_call", lambda *args, **kwargs: None),
        (measure_module, "carries_state", lambda world: False),
        (measure_module, "host_entries", lambda state, kind: None),
        *((module, "agreed", lambda **options: ()) for module in _CALLERS if hasattr(module, "agreed")),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    for module, name, stub in patched:
        setattr(module, name, stub)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _params(n: int, size: int, device: torch.device) -> dict[str, torch.nn.Parameter]:
    torch.manual_seed(0)
    params = {f"layers.{i}.w": torch.nn.Parameter(torch.zeros(size, device=device)) for i in range(n)}
    for p in params.values():
        p.grad = torch.randn(size, device=device)
    return params


def _device(mesh) -> torch.device:
    """The device the mesh's ranks hold their tensors on (on CUDA, the rank's current one)."""
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def _done(device: torch.device) -> None:
    """Waits for the device's queued work, so that a call's time is its whole time."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def _pair(call, device: torch.device, call_without=None) -> dict:
    """``call`` with the checks and ``call_without`` (default: ``call``) without, as interleaved variants,
    each waited for on ``device``."""
    call_without = call_without or call

    def with_checks():
        call()
        _done(device)

    def without():
        with checks_off():
            call_without()
        _done(device)

    return {"with": with_checks, "without": without}


def _stepping(clip, device: torch.device) -> dict:
    """:func:`_pair` of the adaptive ``clip(state)``, each variant passing back the state its last call
    returned, as a training loop does (each steps on a state of its own)."""

    def call() -> None:
        state[0] = clip(state[0]).state

    def call_without() -> None:
        state_without[0] = clip(state_without[0]).state

    state, state_without = [init_clip_state(device)], [init_clip_state(device)]
    return _pair(call, device, call_without)


def eager_cases(mesh, quick: bool) -> dict[str, dict]:
    device = _device(mesh)
    n, size = (100, 4096) if not quick else (50, 1024)
    params = _params(n, size, device)
    groups = {name: name for name in params}
    index = param_norm_index(params, mesh)
    big = 1e9  # nothing is scaled: every call sees the same grads

    adaptive = _stepping(
        lambda state: adaptive_clip_grad_norm_(params, mesh, state, max_norm=big, param_norms=index), device
    )

    dim, layers = (768, 12) if not quick else (64, 2)
    named = [name for name, _ in gpt_shapes(dim, layers, 50257 if not quick else 512, 1024 if not quick else 64)]
    shapes = [shape for _, shape in gpt_shapes(dim, layers, 50257 if not quick else 512, 1024 if not quick else 64)]
    gpt = dict(zip(named, make_params(make_grads(shapes, torch.float32, device=device)), strict=True))
    gpt_name = f"{len(gpt)} leaves, {numel(shapes) / 1e6:.0f} M elements"

    adaptive_gpt = _stepping(lambda state: adaptive_clip_grad_norm_(gpt, mesh, state, max_norm=big), device)

    return {
        f"adaptive_clip_grad_norm_, GPT-2 shapes ({gpt_name})": adaptive_gpt,
        f"clip_grad_norm_, GPT-2 shapes ({gpt_name})": _pair(lambda: clip_grad_norm_(gpt, mesh, big), device),
        f"clip_grad_norm_, {n} leaves of {size}": _pair(lambda: clip_grad_norm_(params, mesh, big), device),
        f"clip_grad_norm_, {n} leaves of {size}, {n} groups": _pair(
            lambda: clip_grad_norm_(params, mesh, big, groups=groups), device
        ),
        f"adaptive_clip_grad_norm_ with param_norms, {n} leaves of {size}": adaptive,
    }


def _step_with(g, state, mesh):
    return adaptive_clip_grad_norm(g, mesh, state, max_norm=1.0)


def _step_without(g, state, mesh):  # the same, a code object of its own: dynamo caches graphs per code object
    return adaptive_clip_grad_norm(g, mesh, state, max_norm=1.0)


def compiled_case(mesh, quick: bool) -> tuple[str, dict]:
    """The compiled functional adaptive clip, traced and run with the state check and without."""
    device = _device(mesh)
    if quick:
        grads = {name: p.grad for name, p in _params(8, 4096, device).items()}
        what = "8 leaves of 4096"
    else:
        shapes = [s for _, s in gpt_shapes(768, 12, 50257, 1024)]
        names = [n for n, _ in gpt_shapes(768, 12, 50257, 1024)]
        grads = dict(zip(names, make_grads(shapes, torch.float32, device=device), strict=True))
        what = f"GPT-2 shapes ({len(grads)} leaves, {numel(shapes) / 1e6:.0f} M elements)"
    state = init_clip_state(device)
    torch._dynamo.reset()
    fns = {"with": torch.compile(_step_with, fullgraph=True), "without": torch.compile(_step_without, fullgraph=True)}

    def run(variant: str) -> float:
        # Dynamo guards on the library's functions: "without" runs with the checks off, as it was traced.
        with checks_off() if variant == "without" else contextlib.nullcontext():
            return fns[variant](grads, state, mesh)[1].total_norm.item()

    variants = {v: (lambda v=v: run(v)) for v in fns}
    return f"compiled adaptive_clip_grad_norm, {what}", variants  # compiled by the timing's warm-up rounds


def alone(mesh, quick: bool) -> dict[str, float]:
    """Microseconds per call of the options check by itself, on its steady-state path (the call repeated)."""
    from ppclip_func._core.agreement import check_call
    from ppclip_func._core.setup import OPTION_FIELDS, NormOptions, static_options

    world, kind = _world(mesh), norm_kind(2.0)
    n = 100 if not quick else 50
    groups = {f"layers.{i}.w": f"layers.{i}.w" for i in range(n)}
    out = {}
    for name, opts in (("options, no groups", NormOptions()), (f"options, {n} groups", NormOptions(groups=groups))):

        def check(opts=opts) -> None:  # as the clip makes it
            key = (kind.p, type(None), *OPTION_FIELDS(opts))
            check_call(world, key, lambda: static_options(kind.p, opts, None), opts.tied)

        check()  # first sight: the gather
        reps = 2000
        t0 = time.perf_counter()
        for _ in range(reps):
            check()
        out[name] = 1e6 * (time.perf_counter() - t0) / reps
    return out


def _world(mesh):
    from ppclip_func._core.layout import pipeline_stages, resolve_world

    return resolve_world(mesh, pipeline_stages(mesh, None, None), [])


def state_check(mesh, n_stats: int):
    """One eager state check as the clip makes it, by itself: a ClipState's entries, their place at the
    end of a statistics vector of ``n_stats`` values and back out of it, and the comparison."""
    from ppclip_func._core.agreement import host_entries, state_entries, states_agree

    world, kind, device = _world(mesh), norm_kind(2.0), _device(mesh)
    state = init_clip_state(device)
    norm = torch.tensor(1.0, dtype=torch.float64, device=device)  # finite: a NaN norm is not checked
    stats = torch.zeros(n_stats, dtype=torch.float64, device=device)
    summed = state_entries(state, kind, stats, host_entries(state, kind)) * float(
        world.mesh.size()
    )  # what agreeing ranks' entries sum to

    def check() -> None:
        own = host_entries(state, kind)
        entries = state_entries(state, kind, stats, own)
        reduced = torch.cat([stats, summed])  # as the clip's one cat of its statistics and the entries
        states_agree(reduced, entries, norm, kind, world, type(state), own)

    return check


def state_check_share(mesh, quick: bool, clip, runs: int) -> dict[str, float]:
    """The state check's time per step and as a share of the smallest eager adaptive clip measured
    (``clip``, run with both checks off), timed interleaved round by round so that both see the machine
    alike: the precise form of that case's with/without ratio."""
    n = 100 if not quick else 50
    check = state_check(mesh, 2 * (n + 1) + 2 * n)  # the groups' and the parameters' entries
    reps = 50

    def checks() -> None:
        for _ in range(reps):
            check()
        _done(_device(mesh))

    t = interleaved({"clip": clip, "checks": checks}, runs=runs, warmup=3, barrier=dist.barrier)
    us = 1e3 * t.ms("checks") / reps
    return {"check_us": us, "clip_without_checks_ms": t.ms("clip"), "share": us / (1e3 * t.ms("clip"))}


# The pieces of the checks on the eager CPU path, where each is called: (module, function, label).
PIECES = (
    ("ppclip_func._core.measure", "check_call", "options: check_call"),
    ("ppclip_func._core.measure", "host_entries", "state: fingerprint on the host"),
    ("ppclip_func._core.measure", "state_entries", "state: its entries as a tensor"),
    ("ppclip_func._core.measure", "states_agree", "state: comparison after the all-reduce"),
)


def in_place(with_checks: Callable[[], None], runs: int) -> dict[str, float]:
    """Microseconds a call of each of :data:`PIECES` takes inside the smallest adaptive clip (``with_checks``,
    run ``runs`` times, a barrier before each): a timer around each call. Inside the clip each piece runs
    cold, after the gradients' pass, at several times its cost alone (the timer adds ~0.1 us a call)."""
    spent = {label: 0 for *_, label in PIECES}
    saved = [(importlib.import_module(module), name) for module, name, _ in PIECES]
    saved = [(module, name, getattr(module, name)) for module, name in saved]

    def timed(fn: Callable, label: str) -> Callable:
        def call(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter_ns() - t0

        return call

    for (module, name, fn), (*_, label) in zip(saved, PIECES, strict=True):
        setattr(module, name, timed(fn, label))
    try:
        for _ in range(runs):
            dist.barrier()
            with_checks()
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
    return {label: ns / 1e3 / runs for label, ns in spent.items()}


KNOWN_US = 40.0  # the calibration: this much busy work added to a call, to see what the timing reads for it


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _pin(rank: int, world: int) -> bool:
    """Pins this rank to a core of its own, where there are enough (unpinned, on a 2-core machine the two
    ranks and their gloo threads share both cores, and a known amount of work read as 1.5-2.8x itself)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world:
        return False
    os.sched_setaffinity(0, {cores[rank]})
    return True


def _time_case(name: str, variants: dict, rounds: int) -> dict:
    """One case's row: with / without, and "without" twice (the spread of an A/A ratio is what a
    with/without ratio can resolve). The smallest adaptive clip also runs "without" plus a known amount
    of busy work: what the timing reads for it."""
    known = name.startswith(SMALLEST)
    timed = {**variants, "without again": variants["without"]}
    if known:
        timed["without, plus known work"] = lambda without=variants["without"]: (without(), _busy(KNOWN_US / 1e6))
    t = interleaved(timed, runs=rounds, warmup=3, barrier=dist.barrier, shuffle=True)
    row = {
        "case": name,
        "with_ms": t.ms("with"),
        "without_ms": t.ms("without"),
        "ratio": t.ratio("with", "without"),
        "a_a_ratio": t.ratio("without again", "without"),
        "rounds": rounds,
    }
    if known:
        # (ratio - 1) x the call's time: the extra microseconds the timing reads for KNOWN_US of work.
        row["known_us"] = KNOWN_US
        row["known_read_us"] = (t.ratio("without, plus known work", "without") - 1) * 1e3 * t.ms("without")
        row["checks_read_us"] = (row["ratio"] - 1) * 1e3 * t.ms("without")
    return row


SMALLEST = "adaptive_clip_grad_norm_ with"  # the smallest adaptive clip: the case nearest the goal


def _smallest_rank(rank: int, world: int, quick: bool) -> dict | None:
    """The smallest adaptive clip's row alone, in processes of its own (see :func:`smallest_launches`)."""
    torch.set_num_threads(1)
    _pin(rank, world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    name, variants = next((n, v) for n, v in eager_cases(mesh, quick).items() if n.startswith(SMALLEST))
    row = _time_case(name, variants, 101 if quick else 1001)
    return row if rank == 0 else None


def smallest_launches(launches: int, quick: bool) -> dict:
    """The smallest adaptive clip timed in ``launches`` pairs of new processes: its ratio moves from one
    start of the processes to the next by more than within one (the known work's reading too), so one
    start is not the measurement."""
    rows = [spawn(_smallest_rank, 2, quick, timeout=900)[0] for _ in range(launches)]
    ratios = sorted(r["ratio"] for r in rows)
    return {"rows": rows, "median_ratio": statistics.median(ratios), "ratios": ratios}


def _rank(rank: int, world: int, quick: bool, device_type: str) -> dict | None:
    torch.set_num_threads(1)
    pinned = _pin(rank, world)
    runs = 7 if quick else 41
    if device_type == "cuda":
        torch.cuda.set_device(0)  # the ranks share the one GPU (gloo moves CUDA tensors; NCCL needs one each)
    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
    rows = []
    eager = eager_cases(mesh, quick)
    cases = [*eager.items(), compiled_case(mesh, quick)]
    for name, variants in cases:
        # The small clips (a few ms) get many more rounds: their ratios are the ones near the goal.
        rows.append(_time_case(name, variants, runs if "GPT-2" in name or quick else 1001))
    solo = alone(mesh, quick)
    smallest = next(variants for name, variants in eager.items() if name.startswith(SMALLEST))
    share = state_check_share(mesh, quick, smallest["without"], runs)
    pieces = in_place(smallest["with"], 101 if quick else 801)
    result = {
        "machine": machine(),
        "device": torch.cuda.get_device_name() if device_type == "cuda" else "cpu",
        "torch": torch.__version__,
        "ranks": world,
        "pinned": pinned,
        "runs": runs,
        "rows": rows,
        "alone_us": solo,
        "state_check": share,
        "in_place_us": pieces,
    }
    return result if rank == 0 else None


def one_gpu(quick: bool) -> dict[str, float]:
    """On one GPU, in one process (no second rank sharing it): the eager state check's time per step, and
    the eager adaptive clips it would run in (``mesh=None``: their local work and scaling, no collective),
    each call waited for on the device."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with single_rank_group():
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
        check = state_check(mesh, 2 * 149)
        n, size = (100, 4096) if not quick else (50, 1024)
        small = _params(n, size, device)
        shapes = gpt_shapes(768, 12, 50257, 1024) if not quick else gpt_shapes(64, 2, 512, 64)
        gpt = make_params(make_grads([s for _, s in shapes], torch.float32, device=device))
        reps = 50

        def checks() -> None:
            for _ in range(reps):
                check()
            torch.cuda.synchronize()

        def clip(params) -> Callable[[], None]:
            def run() -> None:
                adaptive_clip_grad_norm_(params, None, init_clip_state(device), max_norm=1e9)
                torch.cuda.synchronize()

            return run

        t = interleaved(
            {"checks": checks, "small": clip(small), "gpt": clip(gpt)}, runs=21 if not quick else 7, warmup=3
        )
    us = 1e3 * t.ms("checks") / reps
    return {
        "check_us": us,
        f"adaptive clip, {n} leaves of {size} (ms)": t.ms("small"),
        "adaptive clip, GPT-2 shapes (ms)": t.ms("gpt"),
        "share of the small clip": us / (1e3 * t.ms("small")),
        "share of the GPT-2 clip": us / (1e3 * t.ms("gpt")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds; writes only with --out")
    parser.add_argument("--out", type=pathlib.Path, help=f"where agree_cost.json goes (default {RESULTS.parent})")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: both ranks on the one GPU, gloo moving CUDA tensors",
    )
    parser.add_argument(
        "--launches",
        type=int,
        default=None,
        help="starts of new processes for the smallest adaptive clip alone (default 5; 1 with --quick)",
    )
    args = parser.parse_args()
    result = spawn(_rank, 2, args.quick, args.device, timeout=1800)[0]
    if args.device == "cpu":
        launches = args.launches if args.launches is not None else (1 if args.quick else 5)
        result["smallest_launches"] = smallest_launches(launches, args.quick)
    if args.device == "cuda":
        result["one_gpu"] = one_gpu(args.quick)
        print("one GPU, one process:", {k: round(v, 4) for k, v in result["one_gpu"].items()})
    for name, us in result["alone_us"].items():
        print(f"check alone, {name}: {us:.1f} us per call")
    share = result["state_check"]
    print(
        f"state check alone (ClipState, eager): {share['check_us']:.1f} us per step, "
        f"{100 * share['share']:.2f} % of the smallest adaptive clip ({share['clip_without_checks_ms']:.3f} ms)"
    )
    for label, us in result["in_place_us"].items():
        print(f"in place, inside the smallest adaptive clip: {label} {us:.1f} us a call")
    for r in result["rows"]:
        print(
            f"{r['case']}: with {r['with_ms']:.3f} ms, without {r['without_ms']:.3f} ms, ratio {r['ratio']:.3f} "
            f"(without / without: {r['a_a_ratio']:.3f})"
        )
        if "known_us" in r:
            print(
                f"  read as extra time: the checks {r['checks_read_us']:.0f} us; {r['known_us']:.0f} us of known "
                f"busy work {r['known_read_us']:.0f} us"
            )
    if "smallest_launches" in result:
        launched = result["smallest_launches"]
        print(
            f"the smallest adaptive clip in {len(launched['rows'])} starts of new processes: ratio median "
            f"{launched['median_ratio']:.3f}, each "
            + ", ".join(f"{r:.3f}" for r in launched["ratios"])
            + " (A/A "
            + ", ".join(f"{r['a_a_ratio']:.3f}" for r in launched["rows"])
            + ")"
        )
    if args.out is not None or not args.quick:
        out = (args.out or RESULTS.parent) / (RESULTS.name if args.device == "cpu" else "agree_cost_cuda.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**result, "quick": args.quick}, indent=1) + "\n")


if __name__ == "__main__":
    main()
