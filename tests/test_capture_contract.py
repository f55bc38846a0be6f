"""What a CUDA graph needs of a step, checked on the CPU: no host read, the same ops, state kept in place.

A step is captured once and replayed: the captured kernels run again on the
same addresses, and nothing on the host runs. So a step can be captured
only if, once warmed up, it (a) reads nothing on the host (no ``.item()``,
no ``bool(tensor)``, no op whose output size depends on values, no tensor
made from Python values, which is a copy from the host), (b) runs the same
ops on the same shapes and dtypes every step, whatever the values (a spike,
a NaN), (c) keeps what lives from one step to the next in tensors whose
storage never changes, written in place, and (d) issues the same one
collective, the options check having gathered once before.

No GPU is lent to CI, so this runs the accelerator's branches on the CPU:
``"cpu"`` is made a device whose foreach norm sums in blocks and whose
values the host cannot read for free (``_base.devices.HOST_MEMORY`` without it),
as on CUDA. The group is a real one-rank gloo group (the collective and the
state's fingerprint move through it). ``tests/test_cuda_graphs.py`` captures
the same steps on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import ppclip_func._base.devices as devices
import ppclip_func._core.scale as scale
import ppclip_func._core.statistics as local
from ppclip_func import (
    AdaGCStateful,
    ClipRecorder,
    ClipStateful,
    adagc_clip_grad_norm_,
    adaptive_clip_grad_norm,
    adaptive_clip_grad_norm_,
    adaptive_clip_grad_norm_in_optimizer,
    clip_grad_norm,
    clip_grad_norm_,
    clip_grad_norm_by_group_,
    clip_grad_norm_in_optimizer,
    param_norm_index,
    select_update,
    write_back_,
)
from tests._collectives import CollectiveCounter
from tests._fake_pg import one_rank_world

# Ops whose result the host must wait for (a value, or an output size that depends on values).
SYNCING_OPS = frozenset(
    {
        "_local_scalar_dense",
        "item",
        "is_nonzero",
        "nonzero",
        "equal",
        "allclose",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "bincount",
        "repeat_interleave",
    }
)
# Python-level reads of a tensor's values on the host, and tensors made from the host's values.
HOST_READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "data_ptr"})
FROM_HOST = frozenset({"tensor", "as_tensor", "frombuffer", "from_numpy"})


class HostReadError(AssertionError):
    """A step read a value on the host, or made a tensor from host data."""


class StepRecorder(TorchDispatchMode):
    """Records every op a step dispatches (name, and the shapes and dtypes it reads and writes); raises
    on an op that syncs with the device."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in SYNCING_OPS:
            raise HostReadError(f"{func} waits for the device")
        if name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _flat(args[1])
        ):
            raise HostReadError(f"{func} with a boolean index (a nonzero: waits for the device)")
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func), _signature(args), _signature(kwargs), _signature(out)))
        return out


class NoHostReads(TorchFunctionMode):
    """Raises on a read of a tensor's values on the host, or a tensor made from Python data, except of
    the meshes' rank tables (CPU tensors of ranks on every device type, not data)."""

    def __init__(self, allowed: list[torch.Tensor]) -> None:
        super().__init__()
        self.allowed = {id(t) for t in allowed}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and not (args and id(args[0]) in self.allowed):
            raise HostReadError(f"Tensor.{name} reads a value on the host")
        if name in FROM_HOST and args and not isinstance(args[0], torch.Tensor):
            raise HostReadError(f"torch.{name} makes a tensor from host data (a copy to the device)")
        return func(*args, **(kwargs or {}))


def _flat(x: Any) -> list[Any]:
    return [y for item in x for y in _flat(item)] if isinstance(x, (list, tuple)) else [x]


def _signature(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_signature(y) for y in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v)) for k, v in x.items())
    return type(x).__name__


@pytest.fixture(scope="module")
def one_rank_mesh() -> Iterator[DeviceMesh]:
    """A one-rank gloo group and mesh in this process (the collective is real, as a one-rank NCCL group's)."""
    with one_rank_world() as mesh:
        yield mesh


@pytest.fixture
def as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU taken through the accelerator's branches."""
    monkeypatch.setattr(local, "BLOCKWISE_FOREACH", local.BLOCKWISE_FOREACH | {"cpu"})
    monkeypatch.setattr(scale, "SAME_DTYPE_FACTOR", scale.SAME_DTYPE_FACTOR | {"cpu"})
    monkeypatch.setattr(devices, "HOST_MEMORY", frozenset())


# The grads each step: ordinary ones, a spike the adaptive clips skip or clip hard, ordinary ones again,
# a NaN, ordinary ones. The first two steps are the warm-up before a capture.
WARMUP = 2
SCALES = (1.0, 1.1, 0.9, 1.2, 1.0, 60.0, 1.0, 0.8, math.nan, 1.1, 1.0, 0.9)


class Model:
    """Parameters with grads whose storage stays put (a capture reads them where they were captured)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(0)
        shapes = {"embed": (64, 16), "w1": (32, 16), "b1": (32,), "w2": (16, 32), "norm": (16,)}
        self.params = {n: torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype) * 0.1) for n, s in shapes.items()}
        self._base = {n: torch.randn(s, generator=gen).to(dtype) for n, s in shapes.items()}
        for p in self.params.values():
            p.grad = torch.empty_like(p)

    def set_grads(self, step: int) -> None:
        """Writes step ``step``'s grads into the same grad tensors."""
        with torch.no_grad():
            for i, (n, p) in enumerate(self.params.items()):
                p.grad.copy_(self._base[n] * (SCALES[step] * (1.0 + 0.01 * ((step + i) % 5))))


GROUPS = {"embed": "embed", "*": "body"}
ADAPTIVE = {"warmup": 3, "skip_z": 4.0, "max_norm": 5.0}


def _variants(mesh: DeviceMesh | None) -> dict[str, Callable[[], Callable[[int], dict[str, torch.Tensor]]]]:
    """Each variant: a factory of (its model and persistent state, and) a step, which returns the
    tensors the step's state lives in (to be kept in place) and its results."""

    def plain_():
        m = Model()
        return m, lambda: {"norm": clip_grad_norm_(m.params, mesh, 1.0)}, {}

    def plain_pure():
        m = Model()

        def step():
            grads, norm = clip_grad_norm({n: p.grad for n, p in m.params.items()}, mesh, 1.0)
            return {"norm": norm, **grads}

        return m, step, {}

    def adaptive_():
        m, clip = Model(), ClipStateful()

        def step():
            stats = adaptive_clip_grad_norm_(m.params, mesh, clip.state, **ADAPTIVE)
            clip.update_(stats.state)
            return {"norm": stats.total_norm, "threshold": stats.threshold, "skip": stats.skip}

        return m, step, {"state": clip.state}

    def adaptive_pure():
        m, clip = Model(), ClipStateful()

        def step():
            grads, stats = adaptive_clip_grad_norm(
                {n: p.grad for n, p in m.params.items()}, mesh, clip.state, **ADAPTIVE
            )
            clip.update_(stats.state)
            return {"skip": stats.skip, "threshold": stats.threshold, **grads}

        return m, step, {"state": clip.state}

    def adagc_():
        m = Model()
        clip = AdaGCStateful(param_norm_index(m.params, mesh))

        def step():
            stats = adagc_clip_grad_norm_(m.params, mesh, clip.state, clip.index, warmup=3, max_norm=5.0)
            clip.update_(stats.state)
            return {"norm": stats.total_norm, "coef": stats.coefficients, "skip": stats.skip}

        return m, step, {"state": clip.state}

    def per_group_():
        m = Model()

        def step():
            total, norms = clip_grad_norm_by_group_(m.params, mesh, GROUPS, 2.0, group_max_norm={"embed": 0.5})
            return {"norm": total, **norms}

        return m, step, {}

    def handed_fused_adamw():
        m = Model()
        opt = torch.optim.AdamW(m.params.values(), lr=1e-2, weight_decay=0.1, fused=True)

        def step():
            norm = clip_grad_norm_in_optimizer(opt, m.params, mesh, 1.0, nonfinite="skip")
            handed = {"grad_scale": opt.grad_scale, "found_inf": opt.found_inf}
            opt.step()
            return {"norm": norm, **handed}

        return m, step, {"opt": opt}

    def adaptive_handed_fused_adamw():
        m, clip = Model(), ClipStateful()
        opt = torch.optim.AdamW(m.params.values(), lr=1e-2, weight_decay=0.1, fused=True)

        def step():
            stats = adaptive_clip_grad_norm_in_optimizer(opt, m.params, mesh, clip.state, **ADAPTIVE)
            clip.update_(stats.state)
            handed = {"grad_scale": opt.grad_scale, "found_inf": opt.found_inf}
            opt.step()
            return {"norm": stats.total_norm, "skip": stats.skip, **handed}

        return m, step, {"state": clip.state, "opt": opt}

    def adaptive_recorded():
        # The clip's statistics and every parameter's norm recorded on the device each step (ClipRecorder).
        m, clip = Model(), ClipStateful()
        index = param_norm_index(m.params, mesh)
        recorder = ClipRecorder(index)

        def step():
            stats = adaptive_clip_grad_norm_(m.params, mesh, clip.state, param_norms=index, **ADAPTIVE)
            clip.update_(stats.state)
            recorder.record(stats)
            return {"norm": stats.total_norm, "skip": stats.skip}

        return m, step, {"state": clip.state, "recorded": [recorder._ring, recorder._count, *recorder.stats]}

    def functional_written_back():
        # The functional recipe's end (docs/cuda-graphs.md): the pure clip, an update selected against a
        # skip, and every new value written into the persistent tensors by one write_back_.
        m, clip = Model(), ClipStateful()
        params = {n: p.detach() for n, p in m.params.items()}

        def step():
            grads, stats = adaptive_clip_grad_norm(
                {n: p.grad for n, p in m.params.items()}, mesh, clip.state, **ADAPTIVE
            )
            new = {n: p - 1e-2 * grads[n] for n, p in params.items()}
            write_back_((params, clip.state), (select_update(stats.skip, new, params), stats.state))
            return {"skip": stats.skip, "threshold": stats.threshold}

        return m, step, {"state": clip.state}

    return {
        f.__name__: f
        for f in (
            plain_,
            plain_pure,
            adaptive_,
            adaptive_pure,
            adagc_,
            per_group_,
            handed_fused_adamw,
            adaptive_handed_fused_adamw,
            adaptive_recorded,
            functional_written_back,
        )
    }


# The names only: building the factories touches no mesh.
VARIANTS = list(_variants(None))


def _persistent(model: Model, held: dict[str, Any]) -> list[torch.Tensor]:
    """What lives from one step to the next: parameters, grads, the clip's state and the optimizer's state.
    (The grad_scale and found_inf handed to the optimizer are checked from each step's results.)"""
    tensors = [t for p in model.params.values() for t in (p, p.grad)]
    tensors += list(held.get("state", ())) + list(held.get("recorded", ()))
    opt = held.get("opt")
    if opt is not None:
        tensors += [v for p in model.params.values() for v in opt.state[p].values()]
    return tensors


def _run(step: Callable[[], dict], model: Model, held: dict, mesh: DeviceMesh) -> tuple[list, list, list]:
    """Runs every step: the warm-up ones plainly, then each under the recorders. Returns each recorded
    step's ops, collectives and results."""
    ops, collectives, results, handed = [], [], [], []
    for i in range(len(SCALES)):
        model.set_grads(i)
        if i < WARMUP:
            step()
            continue
        with torch.no_grad():
            before = [(t.data_ptr(), t._version) for t in _persistent(model, held)]
        recorder, counter = StepRecorder(), CollectiveCounter()
        with counter, recorder, NoHostReads([mesh.mesh]):
            out = step()
        after = _persistent(model, held)
        assert [t.data_ptr() for t in after] == [p for p, _ in before], f"step {i}: a persistent tensor moved"
        handed.append({k: out[k].data_ptr() for k in ("grad_scale", "found_inf") if k in out})
        assert handed[-1] == handed[0], f"step {i}: the optimizer was handed other grad_scale/found_inf tensors"
        ops.append(recorder.ops)
        collectives.append(counter.ops)
        results.append({k: v.detach().clone() for k, v in out.items()})
    return ops, collectives, results


@pytest.mark.parametrize("variant", VARIANTS)
def test_after_warm_up_every_step_reads_nothing_on_the_host_and_runs_the_same_ops(one_rank_mesh, as_on_cuda, variant):
    model, step, held = _variants(one_rank_mesh)[variant]()
    ops, collectives, _ = _run(step, model, held, one_rank_mesh)
    # (b) The same ops, on the same shapes and dtypes, in the same order, step after step: the spike and
    # the NaN included.
    for i, recorded in enumerate(ops[1:], start=WARMUP + 1):
        assert recorded == ops[0], f"step {i} ran other ops than step {WARMUP}"
    # (d) One collective a step, the statistics' all-reduce: the options check gathered in the warm-up.
    assert all(c == ["_c10d_functional.all_reduce"] for c in collectives), collectives


@pytest.mark.parametrize(
    "variant", ["adaptive_", "adaptive_pure", "adagc_", "adaptive_handed_fused_adamw", "functional_written_back"]
)
def test_the_state_lives_in_the_same_tensors_written_in_place_and_equals_the_pure_steps(
    one_rank_mesh, as_on_cuda, variant
):
    """(c) The holder's tensors keep their storage and take each step's state; the results equal the same
    steps run with the state handed from one pure call to the next."""
    model, step, held = _variants(one_rank_mesh)[variant]()
    state = held["state"]
    versions = []
    for i in range(len(SCALES)):
        model.set_grads(i)
        step()
        versions.append([t._version for t in state])
        assert all(a is b for a, b in zip(state, held["state"]))
    assert all(b > a for a, b in zip(versions[-2], versions[-1]))  # written at every step

    # The same run, state handed on (pure), with the real CPU branches.
    ref_model, ref_state = Model(), None
    if variant == "adagc_":
        index = param_norm_index(ref_model.params, one_rank_mesh)
        ref_state = AdaGCStateful(index).state
    else:
        ref_state = ClipStateful().state
    for i in range(len(SCALES)):
        ref_model.set_grads(i)
        if variant == "adagc_":
            ref_state = adagc_clip_grad_norm_(
                ref_model.params, one_rank_mesh, ref_state, index, warmup=3, max_norm=5.0
            ).state
        else:
            ref_state = adaptive_clip_grad_norm_(ref_model.params, one_rank_mesh, ref_state, **ADAPTIVE).state
    for got, want in zip(state, ref_state):
        assert torch.equal(got, want), (got, want)
    assert state[0].item() < len(SCALES)  # the NaN step (and, for ZClip, the spike) left out of the count


def test_the_contract_checks_can_fail(one_rank_mesh, as_on_cuda):
    """The recorders see what they are for: a host read, a tensor from host data, a changed op."""
    x = torch.ones(3)
    for bad in (lambda: x.sum().item(), lambda: bool(x.sum() > 0), lambda: torch.tensor([1.0, 2.0]), lambda: x[x > 0]):
        with pytest.raises(HostReadError), StepRecorder(), NoHostReads([]):
            bad()
    with StepRecorder() as a:
        torch.where(x > 0, x, 0.0)
    with StepRecorder() as b:
        x * 2.0
    assert a.ops != b.ops
