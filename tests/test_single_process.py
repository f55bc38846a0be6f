"""Single-process semantics: clip_grad_norm with mesh=None is torch's clip, with better numerics.

Every property draws a random pytree of gradients (nested dicts, lists and
tuples; ``None`` leaves; 0-size and scalar tensors; fp32/bf16/fp16/fp64) and
compares against a float64 reference computed the obvious way, and against
``torch.nn.utils.clip_grad_norm_`` where torch's semantics are the same.
"""

from __future__ import annotations

import copy
import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch.utils import _pytree as pytree

from ppclip_func import clip_grad_norm, clip_grad_norm_, clip_grads_with_norm, global_grad_norm
from tests._reference import assert_close_rel, reference_coefficient, reference_norm

NORM_TYPES = [2.0, 1.0, 3.5, 0.0, math.inf, -math.inf]
MAX_NORMS = st.one_of(st.just(0.0), st.floats(1e-3, 50.0))
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@st.composite
def tensors(draw, dtypes=DTYPES):
    shape = draw(st.lists(st.integers(0, 7), min_size=0, max_size=3))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    if draw(st.booleans()):  # some exact zeros, which the 0-"norm" must not count
        t = t * (torch.rand(shape, generator=g, dtype=torch.float64) > 0.3)
    return t.to(dtype)


def grad_trees(dtypes=DTYPES):
    leaf = st.one_of(st.none(), tensors(dtypes))
    return st.recursive(
        leaf,
        lambda children: st.one_of(
            st.lists(children, max_size=4),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(st.sampled_from(["w", "b", "emb", "head", "layers"]), children, max_size=4),
        ),
        max_leaves=10,
    )


def tensor_leaves(tree):
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def rel_tol(tree) -> float:
    # Local sums accumulate in fp32 (fp64 for fp64 grads) whatever the grad dtype.
    return 1e-6


@settings(max_examples=150, deadline=None)
@given(tree=grad_trees(), norm_type=st.sampled_from(NORM_TYPES))
def test_norm_equals_float64_reference(tree, norm_type):
    total = global_grad_norm(tree, None, norm_type)
    assert total.dim() == 0
    leaves = tensor_leaves(tree)
    assert total.dtype == torch.float64  # whatever the leaves (tests/test_norm_dtype.py)
    assert_close_rel(float(total), reference_norm(leaves, norm_type), rel_tol(tree))


@settings(max_examples=150, deadline=None)
@given(
    tree=grad_trees(),
    norm_type=st.sampled_from(NORM_TYPES),
    max_norm=MAX_NORMS,
)
def test_clipped_equals_reference_scaled(tree, norm_type, max_norm):
    clipped, _ = clip_grad_norm(tree, None, max_norm, norm_type)
    coef = reference_coefficient(reference_norm(tensor_leaves(tree), norm_type), max_norm)
    for got, g in zip(tensor_leaves(clipped), tensor_leaves(tree)):
        expected = g.to(torch.float64) * coef
        # One rounding to the grad's dtype, after a coefficient within 1e-6 of the reference.
        tol = torch.finfo(g.dtype).eps + 2e-6
        torch.testing.assert_close(got.to(torch.float64), expected, rtol=tol, atol=torch.finfo(g.dtype).tiny)


@settings(max_examples=100, deadline=None)
@given(
    tree=grad_trees(dtypes=[torch.float32, torch.float64]),
    norm_type=st.sampled_from([2.0, 1.0, 3.5, math.inf, -math.inf]),
    max_norm=MAX_NORMS,
)
def test_matches_torch_clip_grad_norm_(tree, norm_type, max_norm):
    """Same norm and same clipped grads as torch, wherever torch's semantics agree with ours.

    Excluded, because torch differs on purpose: ``norm_type=0`` (torch counts
    leaves with a non-zero norm, not non-zero elements), ±inf norms over
    0-size tensors (torch raises), and mixed fp32/fp64 trees (torch's total
    then depends on leaf order).
    """
    leaves = tensor_leaves(tree)
    if len({t.dtype for t in leaves}) > 1:
        tree = pytree.tree_map(lambda t: t.to(torch.float32) if isinstance(t, torch.Tensor) else t, tree)
        leaves = tensor_leaves(tree)
    if math.isinf(norm_type):
        leaves = [t for t in leaves if t.numel()]
        tree = leaves
    params = [torch.zeros_like(t, requires_grad=True) for t in leaves]
    for p, g in zip(params, leaves):
        p.grad = g.clone()
    torch_total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, foreach=True)

    clipped, total = clip_grad_norm(tree, None, max_norm, norm_type)
    assert_close_rel(float(total), float(torch_total), 1e-6)
    for got, p in zip(tensor_leaves(clipped), params):
        torch.testing.assert_close(got, p.grad, rtol=2e-6, atol=0.0)


@settings(max_examples=60, deadline=None)
@given(tree=grad_trees(), norm_type=st.sampled_from(NORM_TYPES), max_norm=MAX_NORMS)
def test_inputs_unchanged_and_structure_preserved(tree, norm_type, max_norm):
    before = copy.deepcopy(tree)
    clipped, _ = clip_grad_norm(tree, None, max_norm, norm_type)
    assert pytree.tree_structure(clipped) == pytree.tree_structure(tree)
    for a, b, c in zip(pytree.tree_leaves(tree), pytree.tree_leaves(before), pytree.tree_leaves(clipped)):
        if b is None:
            assert a is None and c is None
            continue
        assert torch.equal(a, b), "clip_grad_norm modified its input"
        assert (c.dtype, c.device, c.shape) == (b.dtype, b.device, b.shape)
        assert c is not a


@settings(max_examples=60, deadline=None)
@given(tree=grad_trees(), norm_type=st.sampled_from(NORM_TYPES), max_norm=MAX_NORMS)
def test_inplace_matches_pure(tree, norm_type, max_norm):
    leaves = tensor_leaves(tree)
    params = [torch.zeros_like(t, requires_grad=True) for t in leaves]
    for p, g in zip(params, leaves):
        p.grad = g.clone()
    params.append(torch.zeros(3, requires_grad=True))  # a parameter without a grad is skipped
    total_ = clip_grad_norm_(params, None, max_norm, norm_type)
    clipped, total = clip_grad_norm(tree, None, max_norm, norm_type)
    assert torch.equal(total_, total)
    for p, c in zip(params, tensor_leaves(clipped)):
        assert torch.equal(p.grad, c)
    assert params[-1].grad is None


@settings(max_examples=40, deadline=None)
@given(tree=grad_trees(), norm_type=st.sampled_from(NORM_TYPES), max_norm=MAX_NORMS)
def test_two_step_api_equals_one_step(tree, norm_type, max_norm):
    total = global_grad_norm(tree, None, norm_type)
    two_step = clip_grads_with_norm(tree, max_norm, total)
    one_step, total1 = clip_grad_norm(tree, None, max_norm, norm_type)
    assert torch.equal(total, total1)
    for a, b in zip(tensor_leaves(two_step), tensor_leaves(one_step)):
        assert torch.equal(a, b)


def test_max_norm_as_tensor_equals_float():
    grads = {"a": torch.randn(10, 10), "b": [torch.randn(7)]}
    c_float, n_float = clip_grad_norm(grads, None, 0.5)
    c_tensor, n_tensor = clip_grad_norm(grads, None, torch.tensor(0.5))
    assert torch.equal(n_float, n_tensor)
    for a, b in zip(tensor_leaves(c_float), tensor_leaves(c_tensor)):
        assert torch.equal(a, b)


def test_clipping_is_not_vacuous():
    grads = [torch.full((100,), 1.0)]
    clipped, total = clip_grad_norm(grads, None, 1.0)
    assert float(total) == 10.0
    assert float(torch.linalg.vector_norm(clipped[0])) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_empty_tree_has_norm_zero(norm_type):
    for tree in ([], {}, None, {"a": None, "b": [None]}):
        clipped, total = clip_grad_norm(tree, None, 1.0, norm_type)
        assert float(total) == 0.0 and total.dtype == torch.float64
        assert pytree.tree_structure(clipped) == pytree.tree_structure(tree)


@pytest.mark.parametrize("norm_type", [math.inf, -math.inf])
def test_zero_size_leaves_are_skipped_for_max_and_min(norm_type):
    grads = [torch.zeros(0), torch.tensor([-3.0, 0.5]), torch.zeros(2, 0)]
    expected = 3.0 if norm_type > 0 else 0.5
    assert float(global_grad_norm(grads, None, norm_type)) == expected


def test_low_precision_grads_accumulate_in_fp32():
    # 2**14 bf16 ones: a bf16 accumulator stalls at 256; an fp32 one is exact. The 2-norm's rows
    # come back as fp32 roots (sqrt(2048), rounded) and are squared in float64: within 1e-7.
    grads = [torch.ones(2**14, dtype=torch.bfloat16)]
    assert float(global_grad_norm(grads, None, 1.0)) == 2.0**14
    assert float(global_grad_norm(grads, None, 2.0)) == pytest.approx(2.0**7, rel=1e-7)


def test_generator_of_parameters_is_consumed_once_and_clipped():
    params = [torch.zeros(4, requires_grad=True) for _ in range(3)]
    for p in params:
        p.grad = torch.full((4,), 2.0)
    total = clip_grad_norm_((p for p in params), None, 1.0)
    assert float(total) == pytest.approx(math.sqrt(48.0))
    for p in params:
        assert float(p.grad[0]) == pytest.approx(2.0 / math.sqrt(48.0), rel=1e-5)


def test_named_parameters_dict_is_accepted():
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.ones(2, 3)
    model.bias.grad = torch.ones(2)
    total = clip_grad_norm_(dict(model.named_parameters()), None, 100.0)
    assert float(total) == pytest.approx(math.sqrt(8.0))


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_large_leaves_are_chunked_without_changing_the_norm(norm_type, dtype):
    g = torch.Generator().manual_seed(7)
    big = torch.randn(3 * 4096 + 1234, generator=g, dtype=torch.float64)
    big[::5] = 0.0  # zeros for the 0-"norm"
    exact_rows = torch.randn(2, 4096, generator=g, dtype=torch.float64)
    # Dense in memory order: permuted back, then reduced in rows like a contiguous leaf.
    transposed = torch.randn(300, 400, generator=g, dtype=torch.float64).t()
    assert not transposed.is_contiguous() and transposed.t().is_contiguous()
    wide = torch.randn(300, 401, generator=g, dtype=torch.float64)
    # .to keeps the strides of a dense tensor: the converted one is transposed too.
    grads = [t.to(dtype) for t in (big, exact_rows, transposed)] + [torch.randn(3, generator=g).to(dtype)]
    # Contiguous under no permutation: reduced in blocks copied out of it.
    column_slice = wide.to(dtype)[:, :400]
    assert not column_slice.is_contiguous() and not column_slice.t().is_contiguous()
    grads.append(column_slice)
    assert_close_rel(float(global_grad_norm(grads, None, norm_type)), reference_norm(grads, norm_type), 1e-6)


@pytest.mark.parametrize("container", [list, type("ParameterList", (list,), {}), tuple, dict])
def test_parameters_in_a_list_subclass_or_other_container_are_clipped_alike(container):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    for p, v in zip(params, (3.0, 4.0)):
        p.grad = torch.full((2,), v)
    given = container({str(i): p for i, p in enumerate(params)}) if container is dict else container(params)
    total = clip_grad_norm_(given, None, 1.0)
    assert_close_rel(float(total), reference_norm([torch.full((2,), 3.0), torch.full((2,), 4.0)], 2.0), 1e-6)
    assert_close_rel(float(params[1].grad[0]), 4.0 / float(total), 1e-6)
