"""Which leaves a ``groups=`` or ``tied=`` pattern selects: whole parts of the dotted name, nothing by accident."""

from __future__ import annotations

import math

import pytest
import torch

from ppclip_func import clip_grad_norm_, global_grad_norm

NAMES = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.w", "layers.01.w1", "w"]


def _grads() -> dict[str, torch.Tensor]:
    return {name: torch.full((2,), float(i + 1)) for i, name in enumerate(NAMES)}


def _norm_of(*names: str) -> float:
    return math.sqrt(sum(2 * (NAMES.index(n) + 1) ** 2 for n in names))


@pytest.mark.parametrize(
    ("pattern", "selected"),
    [
        ("w", ["layers.0.attention.w", "w"]),  # not wq, not w1
        ("layers.0", ["layers.0.attention.wq.weight", "layers.0.attention.w"]),  # not layers.01
        ("attention.wq", ["layers.0.attention.wq.weight"]),
        ("tok_embeddings.weight", ["tok_embeddings.weight"]),
        ("weight", ["tok_embeddings.weight", "layers.0.attention.wq.weight"]),
    ],
)
def test_a_string_pattern_selects_whole_parts_of_the_name(pattern, selected):
    _, groups = global_grad_norm(_grads(), None, groups={"g": pattern})
    assert float(groups["g"]) == pytest.approx(_norm_of(*selected))


def test_a_predicate_sees_the_dotted_name():
    seen = []
    global_grad_norm({"a": {"b": [torch.ones(1)]}}, None, groups={"g": lambda name: seen.append(name) or True})
    assert seen == ["a.b.0"]


def test_a_group_that_matches_no_leaf_anywhere_is_nan_not_zero():
    total, groups = global_grad_norm(_grads(), None, groups={"typo": "tok_embedding", "zeros": "w"})
    assert math.isnan(float(groups["typo"]))
    assert float(total) == pytest.approx(_norm_of(*NAMES))


def test_a_group_of_zero_gradients_has_norm_zero():
    grads = {"w": torch.zeros(3), "b": torch.ones(1)}
    for norm_type in (2.0, math.inf, -math.inf, 0.0):
        _, groups = global_grad_norm(grads, None, norm_type, groups={"w": "w"})
        assert float(groups["w"]) == 0.0, norm_type


def test_a_tied_name_counts_only_that_parameter():
    # tied={"w": 2} must not halve wq or w1's contribution.
    total = global_grad_norm(_grads(), None, tied={"w": 2})
    halved = {"layers.0.attention.w", "w"}
    expected = math.sqrt(sum(2 * (i + 1) ** 2 * (0.5 if n in halved else 1.0) for i, n in enumerate(NAMES)))
    assert float(total) == pytest.approx(expected)


def test_a_tied_name_matching_no_leaf_raises():
    model = torch.nn.Linear(2, 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(
        ValueError, match=r"tied\['tok_embeddings.weight'\] matches none of this rank's gradient leaves \('0', '1'\)"
    ):
        clip_grad_norm_(model.parameters(), None, 1.0, tied={"tok_embeddings.weight": 2})
    assert torch.equal(model.weight.grad, torch.ones(2, 2)), "nothing was scaled"
    # With names, the same declaration is found.
    clip_grad_norm_(dict(model.named_parameters()), None, 1.0, tied={"weight": 2})


@pytest.mark.parametrize("pattern", ["", ".attention.", "layers..0"])
def test_a_pattern_with_an_empty_part_is_rejected(pattern):
    with pytest.raises(ValueError, match="is not a dotted name"):
        global_grad_norm(_grads(), None, groups={"g": pattern})
    with pytest.raises(ValueError, match="is not a dotted name"):
        global_grad_norm(_grads(), None, tied={pattern: 2})
