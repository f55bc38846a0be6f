"""The clip and the optimizer step captured in a CUDA graph and replayed, on a GPU (skipped without CUDA).

``tests/test_capture_contract.py`` checks on the CPU what a capture needs;
here the steps are captured for real, in the two ways users capture them:

1. ``torch.compile(step, mode="reduce-overhead", fullgraph=True)`` over a
   pure clip, torch's functional ``adamw`` (foreach, capturable, float64
   step counts on the GPU) and ``select_update``, reading persistent
   tensors marked static and returning their next values (copied back
   after each call): inductor's cudagraph trees record the step once and
   replay it, with no skip, no split and no recompile.
2. ``torch.cuda.graph`` around an in-place clip and a fused capturable
   ``AdamW.step()``, after a warm-up on a side stream, replayed step after
   step with the grads copied into the same ``.grad`` tensors.

Both run the contract's steps (``SCALES``: a spike the adaptive clips skip,
a NaN every clip skips) and must equal the same steps run eagerly: bit for
bit for replays of eager code, within 1e-6 for inductor's kernels. Replays
run under ``torch.cuda.set_sync_debug_mode("error")``. The group is a
one-rank NCCL group: a 1-D mesh issues its all-reduce even with one rank,
so the collective is captured with the rest.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.optim.adamw import adamw

from ppclip_func import (
    AdaGCState,
    AdaGCStateful,
    ClipRecorder,
    ClipState,
    ClipStateful,
    adagc_clip_grad_norm,
    adagc_clip_grad_norm_,
    adaptive_clip_grad_norm,
    adaptive_clip_grad_norm_,
    adaptive_clip_grad_norm_in_optimizer,
    clip_grad_norm,
    clip_grad_norm_,
    clip_grad_norm_by_group,
    clip_grad_norm_by_group_,
    clip_grad_norm_in_optimizer,
    init_adagc_state,
    init_clip_state,
    param_norm_index,
    select_update,
    skip_update_,
    write_back_,
)
from tests._collectives import CollectiveCounter
from tests.test_capture_contract import ADAPTIVE, GROUPS, SCALES, WARMUP, Model

pytestmark = [
    pytest.mark.skipif(
        not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs a CUDA GPU and NCCL"
    ),
    pytest.mark.filterwarnings("ignore:This instance was constructed with capturable=True:UserWarning"),
]

NAN_STEP = next(i for i, s in enumerate(SCALES) if math.isnan(s))
SPIKE_STEP = SCALES.index(max(s for s in SCALES if not math.isnan(s)))
ADAMW = {"amsgrad": False, "beta1": 0.9, "beta2": 0.95, "lr": 1e-2, "weight_decay": 0.1, "eps": 1e-8, "maximize": False}
ADAGC = {"warmup": 3, "max_norm": 5.0}
PER_GROUP = {"max_norm": 2.0, "group_max_norm": {"embed": 0.5}}
RECORDED = 2  # cudagraph trees run a function's first call eagerly (warm-up), record it at the second


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A one-rank NCCL group and mesh in this process."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


class GpuModel(Model):
    """The contract's parameters and grads, on the GPU; ``set_grads`` copies into the same ``.grad`` tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.params = {n: torch.nn.Parameter(p.detach().cuda()) for n, p in self.params.items()}
        self._base = {n: b.cuda() for n, b in self._base.items()}
        for p in self.params.values():
            p.grad = torch.empty_like(p)


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Any op that synchronizes with the host raises inside."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


Step = Callable[[], dict[str, torch.Tensor]]  # one step; returns its results (norms, skip, ...)
Held = Callable[[], dict[str, torch.Tensor]]  # the tensors the run's state lives in, by name
PureStep = Callable[[], tuple[list[torch.Tensor], dict[str, torch.Tensor]]]  # (next state values, results)


def _snapshot(out: dict[str, torch.Tensor], held: Held) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in {**out, **held()}.items()}


def _assert_same_runs(got: list[dict], want: list[dict], rel: float) -> None:
    """Every step's results and state equal: bitwise (``rel=0``) or within ``rel`` of each tensor's largest
    value; NaN and inf where the reference has them, and integers and flags exactly."""
    assert len(got) == len(want) == len(SCALES)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for k in w:
            a, b, where = g[k].cpu(), w[k].cpu(), f"step {i}, {k}"
            assert a.dtype == b.dtype and a.shape == b.shape, where
            finite = torch.isfinite(b) if b.is_floating_point() else torch.ones_like(b, dtype=torch.bool)
            exact = ~finite if rel and b.is_floating_point() else torch.ones_like(finite)
            torch.testing.assert_close(a[exact], b[exact], rtol=0, atol=0, equal_nan=True, msg=where)
            if not exact.all():
                err = float((a[finite].double() - b[finite].double()).abs().max())
                assert err <= rel * float(b[finite].double().abs().max()), f"{where}: off by {err:.3g}"


def _assert_skips(run: list[dict], skipped: set[int]) -> None:
    """The ``skipped`` steps moved no parameter nor optimizer state; every other step moved the parameters."""
    for i in range(1, len(SCALES)):
        moved = {k for k in run[i] if k.startswith("param.") and not torch.equal(run[i][k], run[i - 1][k])}
        if i in skipped:
            held = [k for k in run[i] if k.startswith(("param.", "opt."))]
            assert all(torch.equal(run[i][k], run[i - 1][k]) for k in held), f"step {i} was not skipped"
            assert "skip" not in run[i] or bool(run[i]["skip"]), f"step {i}"
        else:
            assert moved, f"step {i} moved nothing"


def _skipped(kind: str) -> set[int]:
    return {NAN_STEP, SPIKE_STEP} if kind.startswith("adaptive") else {NAN_STEP}


def _eager_run(step: Step, model: GpuModel, held: Held) -> list[dict[str, torch.Tensor]]:
    """Every step run eagerly: the reference."""
    run = []
    for i in range(len(SCALES)):
        model.set_grads(i)
        run.append(_snapshot(step(), held))
    return run


# 1. Compiled with mode="reduce-overhead": the pure clips, functional AdamW, select_update.


def _pure_step(kind: str, model: GpuModel, mesh: DeviceMesh) -> tuple[PureStep, list[torch.Tensor], Held]:
    """The pure clip ``kind`` + functional AdamW on copies + ``select_update``: returns the step, the
    persistent tensors (parameters, moments, step counts, the clip's state; marked static, so cudagraph
    trees read them in place) and their names. The step returns their next values, in that order, and its
    results."""
    params, grads = list(model.params.values()), {n: p.grad for n, p in model.params.items()}
    moments = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), dtype=torch.float64, device="cuda") for _ in params]
    index = param_norm_index(model.params, mesh) if kind == "adagc" else None
    state: tuple[torch.Tensor, ...] = ()
    if kind == "adaptive":
        state = tuple(init_clip_state("cuda"))
    elif kind == "adagc":
        state = tuple(init_adagc_state(index, "cuda"))
    old = (params, *moments, steps)
    persistent = [t for ts in (*old, state) for t in ts]
    for t in [*grads.values(), *persistent]:
        torch._dynamo.mark_static_address(t)

    def clip() -> tuple[dict, torch.Tensor, tuple, dict]:
        """(clipped grads, skip, the clip's new state, results)."""
        if kind == "plain":
            clipped, norm = clip_grad_norm(grads, mesh, 1.0)
            return clipped, ~torch.isfinite(norm), state, {"norm": norm}
        if kind == "per_group":
            clipped, norm, norms = clip_grad_norm_by_group(grads, mesh, GROUPS, **PER_GROUP)
            return clipped, ~torch.isfinite(norm), state, {"norm": norm, **{f"group.{k}": v for k, v in norms.items()}}
        if kind == "adaptive":
            clipped, stats = adaptive_clip_grad_norm(grads, mesh, ClipState(*state), **ADAPTIVE)
            out = {"norm": stats.total_norm, "threshold": stats.threshold}
        else:
            clipped, stats = adagc_clip_grad_norm(grads, mesh, AdaGCState(*state), index, **ADAGC)
            out = {"norm": stats.total_norm, "coef": stats.coefficients}
        return clipped, stats.skip, tuple(stats.state), {**out, "skip": stats.skip}

    def step() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        with torch.no_grad():
            clipped, skip, new_state, out = clip()
            new = tuple([t.clone() for t in ts] for ts in old)
            adamw(new[0], list(clipped.values()), new[1], new[2], [], new[3], foreach=True, capturable=True, **ADAMW)
            kept = select_update(skip, new, old)
        return [t for ts in (*kept, new_state) for t in ts], out

    def held() -> dict[str, torch.Tensor]:
        named = {f"param.{n}": p for n, p in model.params.items()}
        named.update({f"opt.{j}.{n}": t for j, ts in enumerate((*moments, steps)) for n, t in zip(grads, ts)})
        return {**named, **{f"state.{j}": t for j, t in enumerate(state)}}

    return step, persistent, held


def _written_back(step: PureStep, persistent: list[torch.Tensor]) -> Step:
    """``step``, its next values copied into the persistent tensors after it, outside the graph (a hand-written
    ``_foreach_copy_`` is right there; inside a compiled graph, see :func:`_written_back_inside`)."""

    def run() -> dict[str, torch.Tensor]:
        new, out = step()
        with torch.no_grad():
            torch._foreach_copy_(persistent, new)
        return out

    return run


def _written_back_inside(step: PureStep, persistent: list[torch.Tensor]) -> Step:
    """``step`` with its next values written into the persistent tensors by ``write_back_``, inside the same
    function, which returns only the step's results: docs/cuda-graphs.md's recipe."""

    def run() -> dict[str, torch.Tensor]:
        new, out = step()
        write_back_(persistent, new)
        return out

    return run


def _calls(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> list[None]:
    """A list that grows by one at each call of ``cls.name``."""
    calls, method = [], getattr(cls, name)

    def counted(self, *args, **kwargs):
        calls.append(None)
        return method(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.parametrize("kind", ["plain", "adaptive", "adagc", "per_group"])
def test_reduce_overhead_records_the_step_once_and_its_replays_equal_eager(mesh, kind, monkeypatch):
    from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

    eager_model = GpuModel()
    eager_step, eager_persistent, eager_held = _pure_step(kind, eager_model, mesh)
    want = _eager_run(_written_back(eager_step, eager_persistent), eager_model, eager_held)

    torch._dynamo.reset()
    counters.clear()
    recorded = _calls(monkeypatch, CUDAGraphTreeManager, "record_function")
    replayed = _calls(monkeypatch, CUDAGraphTreeManager, "execute_node")
    model = GpuModel()
    step, persistent, held = _pure_step(kind, model, mesh)
    compiled = _written_back(torch.compile(step, mode="reduce-overhead", fullgraph=True), persistent)
    got = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(len(SCALES)):
            with no_host_sync() if i >= RECORDED else contextlib.nullcontext():
                model.set_grads(i)
                torch.compiler.cudagraph_mark_step_begin()
                got.append(_snapshot(compiled(), held))  # copied before the next replay overwrites it
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["inductor"]["cudagraph_partitions"] == 0  # the graph was not split around an unsafe op
    assert counters["stats"]["unique_graphs"] == 1
    assert (len(recorded), len(replayed)) == (1, len(SCALES) - RECORDED)
    _assert_same_runs(got, want, rel=1e-6)
    _assert_skips(got, _skipped(kind))
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["adaptive", "adagc"])
def test_reduce_overhead_with_the_write_back_in_the_graph_equals_eager(mesh, kind, monkeypatch):
    """The recipe as docs/cuda-graphs.md writes it: the persistent tensors marked static, written inside the
    captured graph by ``write_back_``, the state not returned; recorded once, replayed, equal to eager."""
    from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

    eager_model = GpuModel()
    eager_step, eager_persistent, eager_held = _pure_step(kind, eager_model, mesh)
    want = _eager_run(_written_back(eager_step, eager_persistent), eager_model, eager_held)

    torch._dynamo.reset()
    counters.clear()
    recorded = _calls(monkeypatch, CUDAGraphTreeManager, "record_function")
    model = GpuModel()
    step, persistent, held = _pure_step(kind, model, mesh)
    for t in persistent:
        torch._dynamo.mark_static_address(t)
    storage = [t.data_ptr() for t in persistent]
    compiled = torch.compile(_written_back_inside(step, persistent), mode="reduce-overhead", fullgraph=True)
    got = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(len(SCALES)):
            with no_host_sync() if i >= RECORDED else contextlib.nullcontext():
                model.set_grads(i)
                torch.compiler.cudagraph_mark_step_begin()
                got.append(_snapshot(compiled(), held))
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["stats"]["unique_graphs"] == 1
    assert len(recorded) == 1
    assert [t.data_ptr() for t in persistent] == storage
    _assert_same_runs(got, want, rel=1e-6)
    _assert_skips(got, _skipped(kind))
    torch._dynamo.reset()


# 2. torch.cuda.graph around an in-place clip and a fused capturable AdamW's step().


def _in_place_step(kind: str, model: GpuModel, mesh: DeviceMesh) -> tuple[Step, Held]:
    """One step of the in-place clip ``kind`` + the fused step: skipped in the kernel where the clip is
    handed to the optimizer, else undone by ``skip_update_`` (where the clip's state is written in place)."""
    params, betas = model.params, (ADAMW["beta1"], ADAMW["beta2"])
    opt = torch.optim.AdamW(
        params.values(), ADAMW["lr"], betas, weight_decay=ADAMW["weight_decay"], fused=True, capturable=True
    )
    holder = ClipStateful("cuda") if kind.startswith("adaptive") else None
    if kind == "adagc":
        holder = AdaGCStateful(param_norm_index(params, mesh), "cuda")

    def opt_state() -> list[torch.Tensor]:
        return [t for p in params.values() for t in opt.state[p].values()]

    def stepped(skip: torch.Tensor) -> None:
        skip_update_(skip, [*params.values(), *opt_state()], opt.step)

    def step() -> dict[str, torch.Tensor]:
        if kind == "handed":
            out = {"norm": clip_grad_norm_in_optimizer(opt, params, mesh, 1.0, nonfinite="skip")}
            opt.step()
        elif kind == "adaptive_handed":
            stats = adaptive_clip_grad_norm_in_optimizer(opt, params, mesh, holder.state, **ADAPTIVE)
            holder.update_(stats.state)
            opt.step()
            out = {"norm": stats.total_norm, "threshold": stats.threshold, "skip": stats.skip}
        elif kind in ("adaptive", "adagc"):
            clip = adaptive_clip_grad_norm_ if kind == "adaptive" else adagc_clip_grad_norm_
            extra = (holder.index,) if kind == "adagc" else ()
            stats = clip(params, mesh, holder.state, *extra, **(ADAGC if kind == "adagc" else ADAPTIVE))
            holder.update_(stats.state)
            stepped(stats.skip)
            out = {"norm": stats.total_norm, "skip": stats.skip}
        else:
            if kind == "plain":
                out = {"norm": clip_grad_norm_(params, mesh, 1.0)}
            else:
                norm, norms = clip_grad_norm_by_group_(params, mesh, GROUPS, **PER_GROUP)
                out = {"norm": norm, **{f"group.{k}": v for k, v in norms.items()}}
            stepped(~torch.isfinite(out["norm"]))
        return out

    def held() -> dict[str, torch.Tensor]:
        named = {f"param.{n}": p for n, p in params.items()}
        named.update({f"opt.{n}.{k}": t for n, p in params.items() for k, t in opt.state[p].items()})
        return {**named, **{f"state.{j}": t for j, t in enumerate(holder.state if holder else ())}}

    return step, held


@pytest.mark.parametrize("kind", ["plain", "adaptive", "adagc", "per_group", "handed", "adaptive_handed"])
def test_a_captured_step_replays_the_eager_steps_bit_for_bit(mesh, kind):
    eager_model = GpuModel()
    eager_step, eager_held = _in_place_step(kind, eager_model, mesh)
    want = _eager_run(eager_step, eager_model, eager_held)

    model = GpuModel()
    step, held = _in_place_step(kind, model, mesh)
    got = []
    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph's documentation does
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(WARMUP):  # the options check's gather, the optimizer's state, the cached constants
            model.set_grads(i)
            got.append(_snapshot(step(), held))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"), no_host_sync(), CollectiveCounter() as c:
        out = step()
    assert c.ops == ["_c10d_functional.all_reduce"]  # the one collective is in the graph
    for i in range(WARMUP, len(SCALES)):
        with no_host_sync():
            model.set_grads(i)
            graph.replay()
            got.append(_snapshot(out, held))
    _assert_same_runs(got, want, rel=0.0)
    _assert_skips(got, _skipped(kind))


def test_the_recorder_captured_with_the_step_records_what_eager_records(mesh):
    """``ClipRecorder.record`` captured with the adaptive clip in ``torch.cuda.graph``; ``flush()`` between
    replays (a non-blocking copy to pinned memory, no host sync) and ``read()`` at the end: every record
    equal to an eager run's, bit for bit."""

    def run(capture: bool) -> list:
        model = GpuModel()
        index = param_norm_index(model.params, mesh)
        clip = ClipStateful("cuda")
        recorder = ClipRecorder(index, device="cuda", capacity=len(SCALES))

        def step() -> None:
            stats = adaptive_clip_grad_norm_(model.params, mesh, clip.state, param_norms=index, **ADAPTIVE)
            clip.update_(stats.state)
            recorder.record(stats)

        if not capture:
            for i in range(len(SCALES)):
                model.set_grads(i)
                step()
        else:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for i in range(WARMUP):
                    model.set_grads(i)
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"), no_host_sync():
                step()
            for i in range(WARMUP, len(SCALES)):
                with no_host_sync():
                    model.set_grads(i)
                    graph.replay()
                    recorder.flush()
        recorder.flush()
        return recorder.read(wait=True)

    want, got = run(False), run(True)
    assert [r.step for r in got] == list(range(1, len(SCALES) + 1))
    assert [r.to_json() for r in got] == [r.to_json() for r in want]
    assert any(r.spiked for r in got), "the spike is named"
