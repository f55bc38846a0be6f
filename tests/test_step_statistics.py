"""The step's loss statistics ride the clip's one collective; the token normalization is folded into the clip.

The spec, on one process: the global mean loss and token count are the sums
of the ranks' ``LocalLoss``; the clipped gradients are those of the *mean*
loss (computed by autograd on the mean, the obvious way, in float64), clipped
as torch clips them; a non-finite loss, flag or gradient says so; and the
whole call compiles into one graph with one all-reduce and no host read.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from ppclip_func import LocalLoss, StepStats, clip_grad_norm_with_loss, clip_grad_norm_with_loss_
from tests._fake_pg import fake_world
from tests.test_compile_fake_pg import CaptureBackend, assert_one_graph_one_collective

VOCAB, DIM = 11, 6
IGNORE = -100


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, DIM), torch.nn.Linear(DIM, VOCAB)).to(dtype)


def _microbatches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` microbatches of (inputs, targets), of different lengths, with some targets ignored."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randint(0, VOCAB, (2, 5 + 2 * i), generator=g)
        y = torch.randint(0, VOCAB, (2, 5 + 2 * i), generator=g)
        y[0, : 1 + i] = IGNORE
        out.append((x, y))
    return out


def _summed_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")


def _accumulated(model: torch.nn.Module) -> LocalLoss:
    """Gradient accumulation over the microbatches of the summed loss, as a step hands it to the clip."""
    loss_sum, tokens = torch.zeros(()), torch.zeros((), dtype=torch.int64)
    for x, y in _microbatches():
        loss = _summed_loss(model, x, y)
        loss.backward()
        loss_sum += loss.detach()
        tokens += (y != IGNORE).sum()
    return LocalLoss(loss_sum, tokens)


def _reference(max_norm: float, norm_type: float) -> tuple[float, int, dict[str, torch.Tensor], float]:
    """In float64: the mean loss over every valid token, its gradient by autograd, torch's clip of it."""
    model = _model(torch.float64)
    batches = _microbatches()
    tokens = sum(int((y != IGNORE).sum()) for _, y in batches)
    mean = sum(_summed_loss(model, x, y) for x, y in batches) / tokens
    mean.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type))
    return float(mean.detach()), tokens, {n: p.grad for n, p in model.named_parameters()}, norm


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0])
@pytest.mark.parametrize("max_norm", [0.05, 100.0], ids=["clips", "does_not_clip"])
def test_with_accumulation_and_ignored_tokens_the_grads_are_the_mean_losss_clipped(max_norm, norm_type):
    mean, tokens, want, norm = _reference(max_norm, norm_type)
    model = _model()
    loss = _accumulated(model)
    stats = clip_grad_norm_with_loss_(model.parameters(), None, max_norm, loss, norm_type)
    assert isinstance(stats, StepStats)
    assert float(stats.tokens) == tokens and stats.tokens.dtype == torch.float64
    assert float(stats.loss) == pytest.approx(mean, rel=1e-6)
    assert float(stats.total_norm) == pytest.approx(norm, rel=1e-5)
    assert not bool(stats.nonfinite)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), want[name], rtol=1e-5, atol=1e-7)


def test_the_pure_form_returns_what_the_in_place_form_writes():
    model = _model()
    loss = _accumulated(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    clipped, pure = clip_grad_norm_with_loss(grads, None, 0.05, loss)
    inplace = clip_grad_norm_with_loss_(model.parameters(), None, 0.05, loss)
    for a, b in zip(pure, inplace):
        assert torch.equal(a, b)
    for name, p in model.named_parameters():
        assert torch.equal(clipped[name], p.grad), name
        assert not torch.equal(grads[name], p.grad), "the pure form left its input alone"


def test_without_normalize_the_grads_are_clipped_as_given_and_the_loss_reported():
    grads = {"w": torch.tensor([3.0, 4.0])}
    clipped, stats = clip_grad_norm_with_loss(grads, None, 1.0, LocalLoss(torch.tensor(9.0), 3), normalize=False)
    torch.testing.assert_close(clipped["w"], torch.tensor([0.6, 0.8]))
    assert (float(stats.total_norm), float(stats.loss), float(stats.tokens)) == (5.0, 3.0, 3.0)


def test_the_count_of_non_zero_elements_is_not_divided_by_the_tokens():
    grads = {"w": torch.tensor([3.0, 0.0, 4.0])}
    clipped, stats = clip_grad_norm_with_loss(grads, None, 100.0, LocalLoss(8.0, 4), 0.0)
    assert float(stats.total_norm) == 2.0
    torch.testing.assert_close(clipped["w"], torch.tensor([0.75, 0.0, 1.0]))


def test_copies_of_one_loss_are_counted_once():
    grads = {"w": torch.tensor([2.0])}
    _, once = clip_grad_norm_with_loss(grads, None, 1.0, LocalLoss(6.0, 3))
    _, twice = clip_grad_norm_with_loss(grads, None, 1.0, LocalLoss(6.0, 3, copies=2))
    # One rank holds one of the two copies: the sum over both ranks would be the loss once.
    assert (float(twice.loss), float(twice.tokens)) == (2.0, 1.5)
    assert (float(once.loss), float(once.tokens)) == (2.0, 3.0)


@pytest.mark.parametrize(
    "loss, grad",
    [
        (LocalLoss(torch.tensor(math.nan), 4), 1.0),
        (LocalLoss(torch.tensor(math.inf), 4), 1.0),
        (LocalLoss(torch.tensor(2.0), 4, nonfinite=torch.tensor(True)), 1.0),
        (LocalLoss(torch.tensor(0.0), 0), 1.0),
        (LocalLoss(torch.tensor(2.0), 4), math.nan),
    ],
    ids=["nan_loss", "inf_loss", "flagged", "no_tokens", "nan_grad"],
)
def test_a_non_finite_loss_flag_or_gradient_is_reported(loss, grad):
    _, stats = clip_grad_norm_with_loss({"w": torch.tensor([grad, 1.0])}, None, 1.0, loss)
    assert bool(stats.nonfinite)


def test_a_finite_step_is_not_flagged():
    _, stats = clip_grad_norm_with_loss(
        {"w": torch.ones(2)}, None, 1.0, LocalLoss(torch.tensor(2.0), 4, nonfinite=torch.tensor(False))
    )
    assert not bool(stats.nonfinite)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"norm_type": math.inf}, ValueError, "reduces with max"),
        ({"norm_type": -math.inf}, ValueError, "reduces with min"),
        ({"loss": (1.0, 2)}, TypeError, "LocalLoss"),
        ({"loss": LocalLoss(torch.tensor(1.0, dtype=torch.float16), 2)}, TypeError, "overflows float16"),
        ({"loss": LocalLoss(torch.tensor(1.0, dtype=torch.bfloat16), 2)}, TypeError, "bfloat16"),
        ({"loss": LocalLoss(torch.ones(2), 2)}, ValueError, r"loss.loss_sum must be a 0-dim"),
        ({"loss": LocalLoss(1.0, "2")}, TypeError, "loss.tokens"),
        ({"loss": LocalLoss(1.0, 2, copies=0)}, ValueError, "copies"),
        ({"loss": LocalLoss(1.0, 2, nonfinite=True)}, TypeError, "nonfinite"),
        ({"normalize": 1}, TypeError, "normalize"),
        ({"nonfinite": "skip"}, ValueError, "nonfinite must be one of"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_malformed_arguments_are_refused_naming_them(kwargs, error, match):
    args = {"loss": LocalLoss(1.0, 2), **kwargs}
    with pytest.raises(error, match=match):
        clip_grad_norm_with_loss({"w": torch.ones(2)}, None, 1.0, **args)


def test_compiled_on_a_world_mesh_one_graph_one_all_reduce_no_host_read():
    with fake_world(8, rank=5):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
        grads = {"w": torch.randn(16), "b": torch.randn(3)}
        loss = LocalLoss(torch.tensor(12.0), torch.tensor(7), torch.tensor(False))

        def step(grads, loss):
            return clip_grad_norm_with_loss(grads, mesh, 1.0, loss)

        backend = CaptureBackend()
        compiled = torch.compile(step, backend=backend, fullgraph=True)
        got_grads, got = compiled(grads, loss)
        want_grads, want = step(grads, loss)
        assert_one_graph_one_collective(backend)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        for name in grads:
            torch.testing.assert_close(got_grads[name], want_grads[name])
