"""Local statistics: every leaf's norm is within 1e-6 of float64, whatever its size, layout and dtype.

The promise (docs/precision.md): fp32, bf16 and fp16 gradients accumulate in
float32 at least, in short runs, so the norm of any mix of leaves stays within
1e-6 relative of a float64 reference computed the obvious way (concatenate,
widen, one ``vector_norm``); ``0``, ``inf`` and ``-inf`` are exact. The
leaves below are the shapes that take different paths: tiny ones, sizes just
below and above a row, medium leaves, many of them, a leaf of more than a
million elements, a transposed leaf, strided leaves that no permutation makes
contiguous, and empty ones.

Values are uniform in [0, 1): all terms of a sum are positive, the case where
rounding in a long accumulation adds up instead of cancelling.

Every test runs with 1 and with 2 torch threads: the promise must not depend
on the thread count (nor on the CPU or its BLAS: no path here uses one).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Iterator

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import ppclip_func._core.statistics as local
from ppclip_func import clip_grad_norm_, global_grad_norm
from ppclip_func._core.statistics import BLOCK
from tests._collectives import OpCounter
from tests._reference import assert_close_rel, reference_norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NORM_TYPES = [2.0, 1.0, 3.5, math.inf, -math.inf, 0.0]
REL = 1e-6


@pytest.fixture(autouse=True, params=[1, 2], ids=lambda n: f"{n}thread")
def num_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Runs the test with ``request.param`` torch threads, then restores the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(shape, generator=g)
    t.view(-1)[::7] = 0.0  # exact zeros, which the 0-"norm" must not count
    return t.to(dtype)


@functools.cache
def catalogue(dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    """Named leaf sets, one per path through the local statistics (read, never written, by the tests)."""

    def r(*shape: int, seed: int = 0) -> torch.Tensor:
        return _rand(*shape, dtype=dtype, seed=seed)

    return {
        "tiny": [r(3), r(seed=1)],
        "4095": [r(4095)],
        "4097": [r(4097)],
        "medium_8192": [r(8192)],
        "many_medium": [r(8192, seed=i) for i in range(40)],
        "100K": [r(100_003)],
        "32K": [r(32768, seed=i) for i in range(3)],  # the first size read as rows in place
        "many_over_pack": [r(40_001, seed=i) for i in range(30)],  # 1.2 M elements across block ends
        "over_1M": [r(1_200_001)],
        "transposed": [r(1500, 700).t()],
        "column_slice": [r(700, 1501)[:, :1500]],
        "strided_1d": [r(3_000_000)[::3]],
        "empty": [r(0), r(0, 5), r(5)],
    }


def _expect_close(got: torch.Tensor, leaves: list[torch.Tensor], norm_type: float) -> None:
    expected = reference_norm(leaves, norm_type)
    tol = REL if norm_type not in (0.0, math.inf, -math.inf) else 0.0
    assert_close_rel(float(got), expected, tol)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_leaf_shape_alone_is_within_1e6_of_float64(dtype, norm_type):
    for name, leaves in catalogue(dtype).items():
        try:
            _expect_close(global_grad_norm(leaves, None, norm_type), leaves, norm_type)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_leaf_shapes_together_are_within_1e6_of_float64(dtype, norm_type):
    leaves = [t for ts in catalogue(dtype).values() for t in ts]
    _expect_close(global_grad_norm(leaves, None, norm_type), leaves, norm_type)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_mixed_dtypes_in_one_tree_are_within_1e6_of_float64(norm_type):
    leaves = [t for dtype in DTYPES for ts in catalogue(dtype).values() for t in ts[:3]]
    _expect_close(global_grad_norm(leaves, None, norm_type), leaves, norm_type)


@pytest.mark.parametrize("size", [4096, 8192, 32768, 65536, 100_003, 1_200_001])
def test_fp32_leaves_holding_bf16_values_are_within_1e6_of_float64(size):
    # bf16 grads upcast (or reduced in fp32 from bf16, as FSDP2's mixed precision does) have short
    # mantissas; torch's 16-lane fp32 norm then rounds with a bias: 1.5e-6 at 8192 elements, 4.6e-6
    # at 32768, when taken whole.
    leaves = [_rand(size, dtype=torch.bfloat16, seed=size).float() for _ in range(3)]
    _expect_close(global_grad_norm(leaves, None), leaves, 2.0)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_overflow_safe_float64_accumulation_keeps_every_shape_exact_to_1e6(norm_type):
    leaves = [t for ts in catalogue(torch.float32).values() for t in ts] + catalogue(torch.bfloat16)["over_1M"]
    _expect_close(global_grad_norm(leaves, None, norm_type, overflow_safe=True), leaves, norm_type)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)], ids=str)
def test_a_20M_element_column_slice_is_reduced_in_blocks_not_as_one_sum(dtype):
    # Not contiguous under any permutation of its dims. One sequential sum over
    # it loses about 1e-2 relative in fp32 (torch's own norm: 5e-3).
    g = torch.Generator().manual_seed(3)
    leaf = torch.rand(5000, 4001, generator=g).to(dtype)[:, :4000]
    assert not leaf.is_contiguous() and not leaf.t().is_contiguous()
    for norm_type in (2.0, 1.0):
        _expect_close(global_grad_norm([leaf], None, norm_type), [leaf], norm_type)


def test_clip_grad_norm_in_place_matches_the_reference_on_large_bf16_and_strided_leaves():
    leaves = [_rand(2_000_003, dtype=torch.bfloat16, seed=4), _rand(900, 1001, dtype=torch.float32, seed=5)[:, :1000]]
    expected = reference_norm(leaves, 2.0)
    params = [torch.nn.Parameter(torch.empty_like(t)) for t in leaves]
    for p, t in zip(params, leaves):
        p.grad = t.clone()
    total = clip_grad_norm_(params, None, max_norm=1.0)
    assert_close_rel(float(total), expected, REL)
    for p, t in zip(params, leaves):
        want = (t.double() * (1.0 / (expected + 1e-6))).to(t.dtype)
        torch.testing.assert_close(p.grad, want)


def test_many_leaves_cost_at_most_one_op_each():
    """Small leaves share one foreach call; a medium fp32 leaf costs at most one op (torch's own CPU
    foreach runs one norm per leaf inside); bf16 leaves are packed, a few ops per block of 2^19
    elements (a cat in bf16, the conversion, the row norms). Views (free: no data is read) are not
    counted."""

    def ops(leaves: list[torch.Tensor]) -> int:
        with OpCounter() as mode:
            global_grad_norm(leaves, None)
        return mode.n

    assert ops([torch.rand(1000) for _ in range(2000)]) == ops([torch.rand(1000) for _ in range(200)])
    assert ops([torch.rand(8192) for _ in range(2000)]) <= 2000 + 20
    blocks = 2000 * 64 * 128 // BLOCK
    assert ops([torch.rand(64, 128).bfloat16() for _ in range(2000)]) <= 4 * blocks + 10


class ThreadsOfLargeOps(TorchDispatchMode):
    """The torch thread count each op that reads or writes more than ``grain`` elements runs with."""

    def __init__(self, grain: int) -> None:
        super().__init__()
        self.grain = grain
        self.threads: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if not func.is_view and max((t.numel() for t in tensors), default=0) > self.grain:
            self.threads.append(torch.get_num_threads())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_leaves_under_the_grain_are_reduced_on_the_calling_thread(dtype):
    """torch's CPU kernels split an op over threads above at::internal::GRAIN_SIZE (32768 elements), and
    its foreach clip reduces and scales leaves under it one by one, on the calling thread. Packed into
    larger blocks, such leaves must be reduced on the calling thread too: on a machine whose other cores
    are busy, each parallel region waits for one (milliseconds). With 2 torch threads (the fixture puts
    the count back), every op over the grain runs with one, and the count is 2 again after the clip."""
    grain = 1 << 15
    torch.set_num_threads(2)
    leaves = [_rand(n, dtype=dtype, seed=n) for n in [100, 4096, 8192, 20_000, grain] * 40]
    params = [torch.nn.Parameter(torch.empty_like(t)) for t in leaves]
    for p, t in zip(params, leaves):
        p.grad = t.clone()
    with ThreadsOfLargeOps(grain) as mode:
        got = clip_grad_norm_(params, None, 1e30)
    assert mode.threads, "no op read a packed block"
    assert set(mode.threads) == {1}, mode.threads
    assert torch.get_num_threads() == 2
    _expect_close(got, leaves, 2.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_large_leaves_in_their_own_dtype_are_read_on_the_calling_thread(dtype):
    """torch's norm of a whole leaf runs on the calling thread at every size, and a dense fp32 (fp64)
    leaf's row-wise norm reads memory as fast on one thread as on two: on a machine whose other core is
    busy, its parallel regions made ours 1.4x torch's clip of 16 leaves of 1 M elements with 2 threads
    (bench/busy_study.py). Only the bf16/fp16 conversions, compute-bound, use the other threads."""
    grain = 1 << 15
    torch.set_num_threads(2)
    leaves = [_rand(n, dtype=dtype, seed=n) for n in (40_000, 167_772, 1 << 20, 1_100_001)]
    with ThreadsOfLargeOps(grain) as mode:
        got = global_grad_norm(leaves, None)
    assert mode.threads, "no op read a large leaf"
    assert set(mode.threads) == {1}, mode.threads
    assert torch.get_num_threads() == 2
    _expect_close(got, leaves, 2.0)


def test_large_leaves_in_a_compiled_graph_use_every_thread():
    """In a compiled graph the eager code runs as one op (``ppclip_func::cpu_statistic``) beside
    inductor's kernels, which use every torch thread, torch's own compiled norm among them: there the
    row norms of large leaves use them too."""
    from ppclip_func._core.norms import NormKind

    torch.set_num_threads(2)
    leaves = [_rand(n, dtype=torch.float32, seed=n) for n in (40_000, 1 << 20)]
    with ThreadsOfLargeOps(1 << 15) as mode:
        norms, _ = local._EagerCpu(NormKind(2.0, "sum"), False, in_graph=True).run(leaves)
    assert mode.threads and set(mode.threads) == {2}, mode.threads
    got = torch.cat(norms).double().square().sum().sqrt()
    _expect_close(got, leaves, 2.0)


BLAS_OPS = {
    "aten::dot",
    "aten::vdot",
    "aten::mv",
    "aten::addmv",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::matmul",
}


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_no_leaf_is_reduced_by_a_blas_call(dtype, norm_type):
    """A BLAS reduction sums in an order its vendor, the CPU and the thread count choose (an MKL dot of
    65536 bf16-valued elements: 2.7e-6 with 2 threads here, 4.0e-6 with 1). Every path must bound its
    own accumulations instead, so no leaf size or layout may reach one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.name())
            return func(*args, **(kwargs or {}))

    leaves = [_rand(n, dtype=dtype, seed=n) for n in (100, 4097, 8192, 40_000, 65_536, 70_001, 1_100_000)]
    leaves += [_rand(300, 400, dtype=dtype, seed=1).t(), _rand(500, 301, dtype=dtype, seed=2)[:, :300]]
    for tree in (leaves, leaves[2:5], [leaves[3]]):  # mixed sizes; medium leaves alone; one medium leaf
        with Ops() as ops:
            got = global_grad_norm(tree, None, norm_type)
        assert not ops.names & BLAS_OPS, sorted(ops.names & BLAS_OPS)
        _expect_close(got, tree, norm_type)


def test_the_scratch_buffer_is_bounded_and_per_thread():
    leaf = _rand(3_000_000, dtype=torch.bfloat16, seed=6)
    expected = reference_norm([leaf], 2.0)
    results: dict[int, float] = {}

    def clip(i: int) -> None:
        results[i] = float(global_grad_norm([leaf], None))
        buffers = local._SCRATCH.__dict__.get("buffers", {})
        results[-1 - i] = max(b.numel() for b in buffers.values())

    threads = [threading.Thread(target=clip, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert_close_rel(results[i], expected, REL)
        assert results[-1 - i] <= local.BLOCK, "a scratch buffer grew past BLOCK elements"


def test_a_first_call_under_inference_mode_leaves_a_scratch_usable_outside_it():
    leaf = _rand(1_000_000, dtype=torch.float16, seed=7)
    expected = reference_norm([leaf], 2.0)

    def fresh_thread(fn):  # a thread of its own: a fresh per-thread scratch
        out = []
        t = threading.Thread(target=lambda: out.append(fn()))
        t.start()
        t.join()
        return out[0]

    def both() -> tuple[float, float]:
        with torch.inference_mode():
            a = float(global_grad_norm([leaf], None))
        return a, float(global_grad_norm([leaf], None))

    for got in fresh_thread(both):
        assert_close_rel(got, expected, REL)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_parameter_norms_of_every_leaf_shape_are_within_1e6_of_float64(dtype, norm_type):
    from ppclip_func import adaptive_clip_grad_norm, init_clip_state, param_norm_index

    named = {f"{name}.{i}": t for name, leaves in catalogue(dtype).items() for i, t in enumerate(leaves)}
    index = param_norm_index(named, None)
    _, stats = adaptive_clip_grad_norm(named, None, init_clip_state(), norm_type, param_norms=index)
    for name, norm in index.named(stats.param_norms).items():
        try:
            _expect_close(norm, [named[name]], norm_type)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    _expect_close(stats.total_norm, list(named.values()), norm_type)
