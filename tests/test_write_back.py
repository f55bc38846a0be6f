"""State written back in place inside a compiled step is right in every form a user writes, whatever it returns.

A step that keeps its state in persistent tensors ends by writing the new
state into them: ``ClipStateful.update_``, ``AdaGCStateful.update_``,
``skip_update_``'s undo, the optimizer hand-over's ``grad_scale`` and
``found_inf``, and the functional recipe's ``write_back_``. Each form below
is a step as a user writes it, compiled by inductor, returning only its
loss (or nothing), and the same step run eagerly is the reference: after
every one of 12 steps (a spike that ZClip clips at step 8, a NaN that is
skipped at step 10) every field of the clip's state, every parameter and
every optimizer tensor must be within 1e-6 relative.

The control is the same step with the write-back written by hand,
``torch._foreach_copy_(list(clip.state), list(stats.state))``: where the
running torch has the inductor reordering that the package's op avoids
(:data:`REORDERS`, probed in eight lines by
:func:`test_what_the_running_torch_does_with_a_hand_written_write_back`),
that control must come out wrong, which shows these comparisons can fail.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.func import functional_call, grad_and_value
from torch.optim.adamw import adamw
from torch.utils import _pytree as pytree

from demo.optim import AdamWConfig, FunctionalAdamW
from ppclip_func import (
    AdaGCStateful,
    ClipStateful,
    adagc_clip_grad_norm_,
    adaptive_clip_grad_norm,
    adaptive_clip_grad_norm_,
    adaptive_clip_grad_norm_in_optimizer,
    init_clip_state,
    param_norm_index,
    select_update,
    skip_update_,
    write_back_,
)
from ppclip_func._base.torch_compat import _release
from tests._fake_pg import one_rank_world

STEPS = 12
SPIKE, NAN = 8, 10
REL = 1e-6
CLIP = {"max_norm": 5.0, "warmup": 5}
ADAMW = AdamWConfig(lr=3e-2, betas=(0.9, 0.999), weight_decay=0.1, eps=1e-8)

# What torch's inductor (CPU) does with a write-back written by hand inside a compiled function that
# does not return the new values, measured on each release (docs/cuda-graphs.md says the same):
# "foreach_copy": torch._foreach_copy_(state, new) computes a new value into a state tensor before
# an old value still needed is read; "separate_copy": of two separate Tensor.copy_ into graph
# inputs, the second is dropped.
REORDERS = {
    (2, 11): {"foreach_copy": True, "separate_copy": True},
    (2, 12): {"foreach_copy": True, "separate_copy": True},
    (2, 13): {"foreach_copy": True, "separate_copy": True},
    (2, 14): {"foreach_copy": True, "separate_copy": False},
}
RELEASE = _release(torch.__version__)[:2]


# ---------------------------------------------------------------------------------------------
# The eight lines
# ---------------------------------------------------------------------------------------------


def _ema_step(write: Callable[[list[torch.Tensor], list[torch.Tensor]], None], **compile_kw: Any) -> list[float]:
    """A running mean and variance of ``x`` kept in two tensors, updated by a compiled step that returns
    something else: the variance's update reads the *old* mean. Returns ``[mean, var]`` after one step."""
    torch._dynamo.reset()
    mean, var = torch.tensor(2.0, dtype=torch.float64), torch.tensor(0.5, dtype=torch.float64)

    def step(x: torch.Tensor) -> torch.Tensor:
        new_mean = 0.9 * mean + 0.1 * x
        new_var = 0.9 * var + 0.1 * (x - mean) ** 2
        write([mean, var], [new_mean, new_var])
        return x * 2

    torch.compile(step, **compile_kw)(torch.tensor(5.0, dtype=torch.float64))
    torch._dynamo.reset()
    return [float(mean), float(var)]


RIGHT = [0.9 * 2.0 + 0.1 * 5.0, 0.9 * 0.5 + 0.1 * (5.0 - 2.0) ** 2]  # 2.3, 1.35


def _separate_copies(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src):
        d.copy_(s)


def test_what_the_running_torch_does_with_a_hand_written_write_back():
    """The reordering, as torch's releases have it; a release whose behaviour is not recorded in
    :data:`REORDERS` fails here, so that docs/cuda-graphs.md is brought up to date."""
    seen = {
        "foreach_copy": _ema_step(torch._foreach_copy_, fullgraph=True) != pytest.approx(RIGHT),
        "separate_copy": _ema_step(_separate_copies, fullgraph=True) != pytest.approx(RIGHT),
    }
    recorded = REORDERS.get(RELEASE)
    assert recorded is not None, (
        f"torch {torch.__version__} with a hand-written write-back: {seen}; record it in REORDERS and in "
        "docs/cuda-graphs.md"
    )
    assert seen == recorded, f"torch {torch.__version__} now does {seen}, recorded {recorded}: update both"


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_write_back_is_right_where_a_hand_written_copy_is_not(fullgraph, mode):
    assert _ema_step(_write_pairs, fullgraph=fullgraph, mode=mode) == pytest.approx(RIGHT, rel=1e-12)


def _write_pairs(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    write_back_(dst, src)


# ---------------------------------------------------------------------------------------------
# Steps as users write them
# ---------------------------------------------------------------------------------------------


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Regression batches; step SPIKE's are 30 times larger, step NAN's input holds a NaN."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 4, generator=g)
    out = []
    for i in range(STEPS):
        x = torch.randn(32, 8, generator=g)
        y = x @ w
        if i == SPIKE:
            x, y = 30 * x, 30 * y
        if i == NAN:
            x = x.index_fill(0, torch.tensor([3]), math.nan)
        out.append((x, y))
    return out


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


class Form:
    """A training step as a user writes it: what it builds, the step, and the tensors it keeps.

    ``step(x, y)`` trains on one batch and returns the loss or nothing; ``compiled`` says how the
    part of it that is compiled is compiled (``backward`` eagerly before it, or inside it).
    """

    def __init__(self, mesh: DeviceMesh, write: str = "package") -> None:
        self.mesh, self.write = mesh, write
        self.model = make_model()
        self.params = list(self.model.parameters())

    def kept(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor that lives from one step to the next, by what it is."""
        raise NotImplementedError

    def clip_state_write(self, holder: ClipStateful | AdaGCStateful, state: Any) -> None:
        if self.write == "package":
            holder.update_(state)
        else:  # the control: what a user would write by hand
            torch._foreach_copy_(list(holder.state), list(state))


class ZClipThenAdamW(Form):
    """ZClip on ``.grad`` in place, AdamW undone on a skipped step (``skip_update_``), ``clip.update_``."""

    whole_step = False

    def __init__(self, mesh: DeviceMesh, write: str = "package") -> None:
        super().__init__(mesh, write)
        self.clip = ClipStateful()
        self.adamw = FunctionalAdamW(self.params, ADAMW)

    def kept(self):
        a = self.adamw
        return {"clip": list(self.clip.state), "params": self.params, "adamw": [*a.exp_avgs, *a.exp_avg_sqs, *a.steps]}

    def optimizer_step(self) -> None:
        stats = adaptive_clip_grad_norm_(self.params, self.mesh, self.clip.state, **CLIP)
        a = self.adamw
        skip_update_(stats.skip, [self.params, a.exp_avgs, a.exp_avg_sqs, a.steps], a.step)
        self.clip_state_write(self.clip, stats.state)


class WholeStep(ZClipThenAdamW):
    """The same, with the forward and ``loss.backward()`` inside the compiled function (a graph break)."""

    whole_step = True

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.model.zero_grad(set_to_none=False)
        loss = loss_of(self.model, x, y)
        loss.backward()
        self.optimizer_step()
        return loss


class AdaGCThenAdamW(ZClipThenAdamW):
    """AdaGC's per-parameter thresholds in place, AdamW undone on a skip, ``AdaGCStateful.update_``."""

    def __init__(self, mesh: DeviceMesh, write: str = "package") -> None:
        super().__init__(mesh, write)
        self.clip = AdaGCStateful(param_norm_index(dict(self.model.named_parameters()), mesh))

    def optimizer_step(self) -> None:
        named = dict(self.model.named_parameters())
        stats = adagc_clip_grad_norm_(named, self.mesh, self.clip.state, self.clip.index, warmup=5, max_norm=5.0)
        a = self.adamw
        skip_update_(stats.skip, [self.params, a.exp_avgs, a.exp_avg_sqs, a.steps], a.step)
        self.clip_state_write(self.clip, stats.state)


class HandedToFusedAdamW(Form):
    """ZClip handed to torch's fused AdamW (``grad_scale``, ``found_inf``), ``clip.update_``, ``step()``."""

    whole_step = False

    def __init__(self, mesh: DeviceMesh, write: str = "package") -> None:
        super().__init__(mesh, write)
        self.clip = ClipStateful()
        self.opt = torch.optim.AdamW(
            self.params, lr=ADAMW.lr, betas=ADAMW.betas, weight_decay=ADAMW.weight_decay, eps=ADAMW.eps, fused=True
        )

    def kept(self):
        opt_state = [t for p in self.params for t in self.opt.state[p].values()]
        return {"clip": list(self.clip.state), "params": self.params, "adamw": opt_state}

    def optimizer_step(self) -> None:
        stats = adaptive_clip_grad_norm_in_optimizer(self.opt, self.params, self.mesh, self.clip.state, **CLIP)
        self.clip_state_write(self.clip, stats.state)
        self.opt.step()


class Functional(Form):
    """The functional recipe (docs/cuda-graphs.md): grads by ``grad_and_value``, the pure clip, torch's
    functional AdamW on clones, ``select_update``; the new state written back with one ``write_back_``."""

    whole_step = True

    def __init__(self, mesh: DeviceMesh, write: str = "package") -> None:
        super().__init__(mesh, write)
        self.state = {
            "params": {n: p.detach().clone() for n, p in self.model.named_parameters()},
            "exp_avg": {n: torch.zeros_like(p) for n, p in self.model.named_parameters()},
            "exp_avg_sq": {n: torch.zeros_like(p) for n, p in self.model.named_parameters()},
            "step": {n: torch.zeros((), dtype=torch.float64) for n, _ in self.model.named_parameters()},
            "clip": init_clip_state(),
        }

    def kept(self):
        s = self.state
        return {
            "clip": list(s["clip"]),
            "params": list(s["params"].values()),
            "adamw": [*s["exp_avg"].values(), *s["exp_avg_sq"].values(), *s["step"].values()],
        }

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = self.state

        def loss_fn(params):
            return loss_of_params(self.model, params, x, y)

        grads, loss = grad_and_value(loss_fn)(s["params"])
        grads, stats = adaptive_clip_grad_norm(grads, self.mesh, s["clip"], **CLIP)
        new = {k: {n: t.clone() for n, t in s[k].items()} for k in ("params", "exp_avg", "exp_avg_sq", "step")}
        adamw(
            list(new["params"].values()),
            list(grads.values()),
            list(new["exp_avg"].values()),
            list(new["exp_avg_sq"].values()),
            [],
            list(new["step"].values()),
            foreach=True,
            capturable=torch.compiler.is_compiling(),
            amsgrad=False,
            maximize=False,
            beta1=ADAMW.betas[0],
            beta2=ADAMW.betas[1],
            lr=ADAMW.lr,
            weight_decay=ADAMW.weight_decay,
            eps=ADAMW.eps,
        )
        old = {k: s[k] for k in new}
        new = select_update(stats.skip, new, old)
        persistent = {**old, "clip": s["clip"]}
        if self.write == "package":
            write_back_(persistent, {**new, "clip": stats.state})
        else:
            torch._foreach_copy_(pytree.tree_leaves(persistent), pytree.tree_leaves({**new, "clip": stats.state}))
        return loss


def loss_of_params(model: torch.nn.Module, params: dict[str, torch.Tensor], x, y) -> torch.Tensor:
    return torch.nn.functional.mse_loss(functional_call(model, params, (x,)), y)


def run_form(form: Form, compile_kw: dict | None) -> list[dict[str, list[torch.Tensor]]]:
    """Trains ``form`` over :func:`batches`, compiled with ``compile_kw`` or eagerly (``None``); returns
    copies of every kept tensor after each step."""
    torch._dynamo.reset()
    if form.whole_step:
        step = form.step
    else:

        def step(x, y):
            form.model.zero_grad(set_to_none=False)
            loss = loss_of(form.model, x, y)
            loss.backward()
            run_optimizer()
            return loss

    run_optimizer = form.optimizer_step if not form.whole_step else None
    if compile_kw is not None:
        if form.whole_step:
            step = torch.compile(form.step, **compile_kw)
        else:
            run_optimizer = torch.compile(form.optimizer_step, **compile_kw)
    storage = None
    history = []
    for x, y in batches():
        if compile_kw is not None and compile_kw.get("mode") == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        step(x, y)
        kept = form.kept()
        ptrs = [t.data_ptr() for ts in kept.values() for t in ts]
        storage = ptrs if storage is None else storage
        assert ptrs == storage, "a kept tensor moved: the state must be written in place"
        history.append({k: [t.detach().clone() for t in ts] for k, ts in kept.items()})
    torch._dynamo.reset()
    return history


def mismatches(got: list[dict], want: list[dict]) -> list[str]:
    """Where ``got`` differs from ``want`` by more than REL (relative to each tensor's largest value)."""
    bad = []
    for i, (g, w) in enumerate(zip(got, want)):
        for what in w:
            for j, (a, b) in enumerate(zip(g[what], w[what])):
                a64, b64 = a.double(), b.double()
                if torch.equal(a64.isnan(), b64.isnan()) and torch.equal(a64[~a64.isnan()], b64[~b64.isnan()]):
                    continue
                scale = b64.nan_to_num().abs().max().clamp_min(1e-30)
                err = float(((a64 - b64).abs() / scale).nan_to_num(nan=math.inf).max())
                if err > REL:
                    bad.append(f"step {i}, {what}[{j}]: relative error {err:.3g}")
    return bad


FORMS = {
    "zclip": ZClipThenAdamW,
    "zclip_whole_step": WholeStep,
    "adagc": AdaGCThenAdamW,
    "handed_to_fused_adamw": HandedToFusedAdamW,
    "functional": Functional,
}
# How each form is compiled: fullgraph where the form has no graph break (a backward inside the
# step, or the hand-over's bookkeeping, breaks it), and CUDA graphs' mode, which on the CPU compiles the
# same graph and captures nothing.
COMPILED = [
    ("zclip", {"fullgraph": True}),
    ("zclip", {"fullgraph": True, "mode": "reduce-overhead"}),
    ("zclip", {"fullgraph": False}),
    ("zclip_whole_step", {"fullgraph": False}),
    ("adagc", {"fullgraph": True}),
    ("handed_to_fused_adamw", {"fullgraph": False}),
    ("functional", {"fullgraph": True}),
    ("functional", {"fullgraph": True, "mode": "reduce-overhead"}),
    ("functional", {"fullgraph": False}),
]


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with one_rank_world() as m:
        yield m


_EAGER: dict[str, list[dict]] = {}


def eager(name: str, mesh: DeviceMesh) -> list[dict]:
    if name not in _EAGER:
        _EAGER[name] = run_form(FORMS[name](mesh), None)
    return _EAGER[name]


def _id(case: tuple[str, dict]) -> str:
    name, kw = case
    return "-".join([name, "fullgraph" if kw["fullgraph"] else "graph_breaks", *([kw["mode"]] if "mode" in kw else [])])


@pytest.mark.parametrize("case", COMPILED, ids=[_id(c) for c in COMPILED])
def test_a_compiled_step_returning_only_its_loss_keeps_the_eager_state(mesh, case):
    name, compile_kw = case
    want = eager(name, mesh)
    got = run_form(FORMS[name](mesh), compile_kw)
    assert mismatches(got, want) == []


def test_the_eager_steps_clip_the_spike_and_skip_the_nan(mesh):
    """The reference is not vacuous: ZClip's state took the spike clipped and left the NaN step out."""
    want = eager("zclip", mesh)
    counts = [int(h["clip"][0]) for h in want]
    assert counts[NAN] == counts[NAN - 1], "the NaN step must leave the statistics alone"
    assert counts[-1] == STEPS - 1
    params_before, params_at_nan = want[NAN - 1]["params"], want[NAN]["params"]
    assert all(torch.equal(a, b) for a, b in zip(params_before, params_at_nan)), "a skipped step moves nothing"
    assert not all(torch.equal(a, b) for a, b in zip(want[SPIKE - 1]["params"], want[SPIKE]["params"]))


@pytest.mark.parametrize("name", ["zclip", "functional"])
def test_the_same_step_with_a_hand_written_copy_is_wrong_where_torch_reorders(mesh, name):
    """The control: the comparison above fails when the write-back is left to inductor's copy."""
    recorded = REORDERS.get(RELEASE)
    assert recorded is not None, f"torch {torch.__version__} is not recorded in REORDERS"
    got = run_form(FORMS[name](mesh, write="by_hand"), {"fullgraph": True})
    wrong = mismatches(got, eager(name, mesh))
    assert bool(wrong) == recorded["foreach_copy"], wrong[:5]


# ---------------------------------------------------------------------------------------------
# write_back_ itself
# ---------------------------------------------------------------------------------------------


def test_write_back_writes_in_place_and_keeps_storage():
    state = {"w": torch.zeros(3), "m": [torch.zeros(2, 2), torch.tensor(0, dtype=torch.int64)], "none": None}
    kept = [state["w"], *state["m"]]
    ptrs = [t.data_ptr() for t in kept]
    new = {"w": torch.arange(3.0), "m": [torch.ones(2, 2), torch.tensor(7)], "none": None}
    write_back_(state, new)
    assert [state["w"], *state["m"]] == kept and [t.data_ptr() for t in kept] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(kept, [new["w"], *new["m"]]))


def test_write_back_reads_every_new_value_before_writing_any():
    """A swap, and a new value that is a view of another persistent tensor, as a compiled graph may pass them."""
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    write_back_([a, b], [b, a])
    assert a.tolist() == [3.0, 4.0] and b.tolist() == [1.0, 2.0]
    base = torch.arange(4.0)
    x = torch.zeros(2)
    write_back_([base, x], [torch.ones(4), base[:2]])
    assert base.tolist() == [1.0] * 4 and x.tolist() == [0.0, 1.0]


def test_write_back_into_parameters_that_require_grad():
    w = torch.nn.Parameter(torch.zeros(2))
    write_back_([w], [torch.ones(2, requires_grad=True) * 2])
    assert w.tolist() == [2.0, 2.0] and w.requires_grad and w.grad_fn is None


@pytest.mark.parametrize(
    ("persistent", "new", "error", "match"),
    [
        ({"a": torch.zeros(2)}, {"b": torch.zeros(2)}, ValueError, "structure"),
        ([torch.zeros(2)], [torch.zeros(2), torch.zeros(2)], ValueError, "structure"),
        ({"a": torch.zeros(2)}, {"a": torch.zeros(3)}, ValueError, r"new\['a'\] is \(3,\)"),
        ({"a": [torch.zeros(2)]}, {"a": [torch.zeros(2, dtype=torch.float64)]}, TypeError, r"new\['a'\]\[0\] is"),
        ({"a": 1.0}, {"a": torch.zeros(())}, TypeError, r"persistent\['a'\] must be a tensor"),
        ({"a": torch.zeros(())}, {"a": 1.0}, TypeError, r"new\['a'\] must be a tensor"),
    ],
)
def test_write_back_names_the_leaf_that_does_not_match(persistent, new, error, match):
    with pytest.raises(error, match=match):
        write_back_(persistent, new)
