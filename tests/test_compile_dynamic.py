"""Every public form compiles with ``dynamic=True, fullgraph=True`` and equals eager as the shapes change.

A user who compiles their step with ``dynamic=True`` (or whose batch size
changes, so dynamo makes sizes and Python floats symbolic) gets symbolic
numbers in the clip's setup: the option checks must trace (``not x >= 0``
rather than ``math.isnan``). Spec, for each form: compiled once with
``dynamic=True, fullgraph=True``, called on leaves of three different
sizes, it gives what eager gives on the same inputs (norms, clipped
gradients, adaptive statistics), and compiles no second graph. The hand-over
to a fused optimizer (``clip_grad_norm_in_optimizer``) runs at a graph break
by design, as torch's fused ``step()`` does (docs/optimizer.md), and is not
a ``fullgraph`` form. The forms are traced by ``aot_eager`` (dynamo and AOT
autograd, where the failures were); the plain in-place clip and a whole
functional ZClip step also through inductor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import ppclip_func as P

SIZES = (3, 5, 9)


def _grads(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, 4, generator=g) * 3, "b": torch.randn(n, generator=g)}


def _params(n: int, seed: int) -> dict[str, torch.Tensor]:
    """Leaf tensors with gradients. Not ``nn.Parameter``s: dynamo keeps a parameter's shape static
    (``force_parameter_static_shapes``), so parameters of a new size compile anew in torch's own clip too."""
    params = {}
    for k, g in _grads(n, seed).items():
        params[k] = torch.zeros_like(g, requires_grad=True)
        params[k].grad = g
    return params


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


# Each form: (a function of the step's input and a carried state, returning (what to compare, next state);
# the input of size n; the first state).
Form = tuple[Callable[[Any, Any], tuple[Any, Any]], Callable[[int, int], Any], Callable[[], Any]]

GROUPS = {"w": "w", "b": "b"}


def _in_place(clip: Callable[[dict[str, torch.Tensor]], Any]) -> Callable[[Any, Any], tuple[Any, Any]]:
    def step(params: dict[str, torch.Tensor], state: Any) -> tuple[Any, Any]:
        out = clip(params)
        return (out, [p.grad for p in params.values()]), state

    return step


# AdaGC's per-parameter index: built from the parameters' names, outside the compiled step.
INDEX = P.param_norm_index(_params(SIZES[0], 0), None)


def _pure_adaptive(g: Any, state: P.ClipState) -> tuple[Any, Any]:
    clipped, stats = P.adaptive_clip_grad_norm(g, None, state, warmup=2)
    return (clipped, stats.total_norm, stats.threshold, stats.skip), stats.state


def _in_place_adaptive(params: Any, state: P.ClipState) -> tuple[Any, Any]:
    stats = P.adaptive_clip_grad_norm_(params, None, state, warmup=2)
    return ([p.grad for p in params.values()], stats.total_norm, stats.threshold, stats.skip), stats.state


def _pure_adagc(g: Any, state: P.AdaGCState) -> tuple[Any, Any]:
    clipped, stats = P.adagc_clip_grad_norm(g, None, state, INDEX, warmup=1)
    return (clipped, stats.total_norm), stats.state


def _in_place_adagc(params: Any, state: P.AdaGCState) -> tuple[Any, Any]:
    stats = P.adagc_clip_grad_norm_(params, None, state, INDEX, warmup=1)
    return ([p.grad for p in params.values()], stats.total_norm), stats.state


def _loss(n: int) -> P.LocalLoss:
    return P.LocalLoss(torch.tensor(2.5 * n), torch.tensor(3 * n))


def _pure_with_loss(g: Any, state: Any) -> tuple[Any, Any]:
    return P.clip_grad_norm_with_loss(g, None, 1.0, _loss(g["b"].shape[0])), state


def _in_place_with_loss(params: Any, state: Any) -> tuple[Any, Any]:
    stats = P.clip_grad_norm_with_loss_(params, None, 1.0, _loss(params["b"].shape[0]))
    return ([p.grad for p in params.values()], stats), state


FORMS: dict[str, Form] = {
    "global_grad_norm": (lambda g, s: (P.global_grad_norm(g, None), s), _grads, lambda: None),
    "clip_grad_norm": (lambda g, s: (P.clip_grad_norm(g, None, 1.0), s), _grads, lambda: None),
    "clip_grads_with_norm": (
        lambda g, s: (P.clip_grads_with_norm(g, 1.0, torch.linalg.vector_norm(g["w"]).double()), s),
        _grads,
        lambda: None,
    ),
    "clip_grad_norm_": (_in_place(lambda p: P.clip_grad_norm_(p, None, 1.0)), _params, lambda: None),
    "clip_grad_norm_by_group": (
        lambda g, s: (P.clip_grad_norm_by_group(g, None, GROUPS, 1.0, group_max_norm={"w": 0.5}), s),
        _grads,
        lambda: None,
    ),
    "clip_grad_norm_by_group_": (
        _in_place(lambda p: P.clip_grad_norm_by_group_(p, None, GROUPS, 1.0, group_max_norm={"w": 0.5})),
        _params,
        lambda: None,
    ),
    "adaptive_clip_grad_norm": (_pure_adaptive, _grads, P.init_clip_state),
    "adaptive_clip_grad_norm_": (_in_place_adaptive, _params, P.init_clip_state),
    "adagc_clip_grad_norm": (_pure_adagc, _grads, lambda: P.init_adagc_state(INDEX)),
    "adagc_clip_grad_norm_": (_in_place_adagc, _params, lambda: P.init_adagc_state(INDEX)),
    "clip_grad_norm_with_loss": (_pure_with_loss, _grads, lambda: None),
    "clip_grad_norm_with_loss_": (_in_place_with_loss, _params, lambda: None),
}


def _run(step: Callable[[Any, Any], tuple[Any, Any]], make: Callable[[int, int], Any], state: Any) -> list[Any]:
    outs = []
    for i, n in enumerate(SIZES):
        out, state = step(make(n, i), state)
        outs.append((_tensors(out), _tensors(state)))
    return outs


def _assert_same(compiled: list[Any], eager: list[Any]) -> None:
    for (c_out, c_state), (e_out, e_state) in zip(compiled, eager, strict=True):
        assert len(c_out) == len(e_out) and len(c_state) == len(e_state)
        for c, e in zip(c_out + c_state, e_out + e_state):
            torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_form_compiles_with_dynamic_shapes(name: str) -> None:
    step, make, first_state = FORMS[name]
    eager = _run(step, make, first_state())
    torch._dynamo.reset()
    counters.clear()
    compiled = _run(torch.compile(step, dynamic=True, fullgraph=True, backend="aot_eager"), make, first_state())
    _assert_same(compiled, eager)
    assert counters["stats"]["unique_graphs"] == 1, f"{name}: {counters['stats']['unique_graphs']} graphs"


@pytest.mark.slow
def test_in_place_clip_through_inductor_with_dynamic_shapes() -> None:
    step, make, first_state = FORMS["clip_grad_norm_"]
    eager = _run(step, make, first_state())
    torch._dynamo.reset()
    counters.clear()
    _assert_same(_run(torch.compile(step, dynamic=True, fullgraph=True), make, first_state()), eager)
    assert counters["stats"]["unique_graphs"] == 1


def test_functional_zclip_step_with_a_changing_batch() -> None:
    """The functional step of docs/cuda-graphs.md (torch.func.grad_and_value, the adaptive clip, select_update,
    write_back_ and ClipStateful.update_), compiled with dynamic=True through inductor, the batch size changing
    every step: every parameter and the state equal the eager steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, params, (x,)).square().mean()

    def make_step() -> tuple[Callable[[torch.Tensor], torch.Tensor], dict[str, torch.Tensor], P.ClipStateful]:
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        holder = P.ClipStateful()

        def step(x: torch.Tensor) -> torch.Tensor:
            grads, loss = torch.func.grad_and_value(loss_fn)(params, x)
            clipped, stats = P.adaptive_clip_grad_norm(grads, None, holder.state, warmup=2, skip_z=4.0)
            new = {k: params[k] - 0.1 * clipped[k] for k in params}
            P.write_back_(params, P.select_update(stats.skip, new, params))
            holder.update_(stats.state)
            return loss

        return step, params, holder

    batches = [torch.randn(b, 4, generator=torch.Generator().manual_seed(b)) for b in (2, 3, 5, 7, 4)]
    eager_step, eager_params, eager_holder = make_step()
    eager_losses = [eager_step(x) for x in batches]
    torch._dynamo.reset()
    counters.clear()
    step, params, holder = make_step()
    compiled = torch.compile(step, dynamic=True, fullgraph=True)
    losses = [compiled(x) for x in batches]
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager_losses), rtol=1e-6, atol=1e-7)
    for k in params:
        torch.testing.assert_close(params[k], eager_params[k], rtol=1e-6, atol=1e-7)
    for c, e in zip(holder.state, eager_holder.state):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-7)
    assert int(holder.state.count) == len(batches)
    assert counters["stats"]["unique_graphs"] == 1
