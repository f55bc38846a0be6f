"""The statistics in compiled code and on accelerators: accurate, and O(dtype groups) ops on a GPU's host.

Three paths besides the eager CPU one: compiled on CPU, a bucket is one op
(``ppclip_func::cpu_statistic``) that runs the eager code, but for fp32 leaves
of the FSDP-shard band, reduced as rows by inductor; on a device whose
``_foreach_norm`` sums in blocks (CUDA) every leaf goes whole into one call
per dtype, eager or compiled; on any other device, and compiled there, every
dense leaf is reduced as rows of at most ``ROW`` elements (``_traced``). The
compiled ones must keep the 1e-6 promise on every leaf shape as inductor
compiles them (each leaf its own group, so a bad leaf cannot hide in a large
total); the blockwise one must dispatch a number of ops that does not grow
with the leaf count, since on a GPU each op is host work. No GPU is lent to
CI, so it runs here with "cpu" forced into ``BLOCKWISE_FOREACH``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import ppclip_func._core.statistics as local
from ppclip_func import clip_grad_norm_, global_grad_norm
from ppclip_func._core.norms import norm_kind
from tests._collectives import OpCounter
from tests._fake_pg import fake_world
from tests._reference import assert_close_rel, reference_norm


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g).to(dtype)  # positive: rounding adds up, never cancels


def leaf_shapes(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One leaf per traced path: whole in the foreach call, rows tiling the leaf, rows and a partial
    row, a leaf of over a million elements, a transposed one, a column slice."""
    shapes = {
        "tiny": (3,),
        "4095": (4095,),
        "rows_tiling_57344": (57344,),
        "rows_and_partial_100003": (100_003,),
        "fsdp_shard_65536": (64, 1024),
        "over_1M": (1_200_001,),
    }
    leaves = {name: _rand(*shape, dtype=dtype, seed=i) for i, (name, shape) in enumerate(shapes.items())}
    leaves["transposed"] = _rand(1500, 700, dtype=dtype, seed=10).t()
    leaves["column_slice"] = _rand(700, 1501, dtype=dtype, seed=11)[:, :1500]
    return leaves


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_leaf_compiled_by_inductor_is_within_1e6_of_float64(dtype, norm_type):
    leaves = leaf_shapes(dtype)
    groups = {name: name for name in leaves}
    torch._dynamo.reset()
    compiled = torch.compile(lambda g: global_grad_norm(g, None, norm_type, groups=groups), fullgraph=True)
    total, per_leaf = compiled(leaves)
    torch._dynamo.reset()
    for name, leaf in leaves.items():
        assert_close_rel(float(per_leaf[name]), reference_norm([leaf], norm_type), 1e-6, name)
    assert_close_rel(float(total), reference_norm(leaves.values(), norm_type), 1e-6, "total")


@pytest.mark.parametrize("norm_type", [2.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_row_wise_path_compiled_by_inductor_is_within_1e6_of_float64_leaf_by_leaf(dtype, norm_type):
    leaves = leaf_shapes(dtype)
    kind = norm_kind(norm_type)

    def per_leaf(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [kind.root(local._combine(*local._traced([t], kind, False), kind)) for t in tensors]

    torch._dynamo.reset()
    got = torch.compile(per_leaf, fullgraph=True)(list(leaves.values()))
    torch._dynamo.reset()
    for (name, leaf), norm in zip(leaves.items(), got):
        assert_close_rel(float(norm), reference_norm([leaf], norm_type), 1e-6, name)


def test_compiled_on_cpu_the_shard_band_is_row_reductions_and_the_rest_one_op():
    leaves = list(leaf_shapes(torch.float32).values())
    banded = [t for t in leaves if local.ROWS_FROM < t.numel() <= local.TRACED_ROWS and t.is_contiguous()]
    assert len(banded) == 3  # 57344, 100_003 and 64 x 1024
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(lambda g: global_grad_norm(g, None), backend=backend, fullgraph=True)(leaves)
    torch._dynamo.reset()
    (gm,) = graphs
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.ppclip_func.cpu_statistic.default) == 1, calls
    # One row-wise norm per banded leaf, a second for 100_003's partial row; the rest only in the op.
    assert calls.count(torch.linalg.vector_norm) == len(banded) + 1, calls
    assert torch._foreach_norm not in calls


@pytest.mark.parametrize("size", [57344, 100_003])
def test_compiled_fp32_leaves_holding_bf16_values_are_within_1e6_of_float64(size):
    # Short mantissas make a long fp32 accumulation round with a bias (1.5e-6 at 8192 elements taken whole).
    leaves = [_rand(size, dtype=torch.bfloat16, seed=size + i).float() for i in range(3)]
    torch._dynamo.reset()
    got = torch.compile(lambda g: global_grad_norm(g, None), fullgraph=True)(leaves)
    torch._dynamo.reset()
    assert_close_rel(float(got), reference_norm(leaves, 2.0), 1e-6)


@pytest.fixture
def blockwise_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs the accelerator branch on this CPU, as if its foreach norm summed in blocks."""
    monkeypatch.setattr(local, "BLOCKWISE_FOREACH", local.BLOCKWISE_FOREACH | {"cpu"})


def _params(n_leaves: int, dtypes: tuple[torch.dtype, ...]) -> list[torch.nn.Parameter]:
    params = []
    for i in range(n_leaves):
        grad = _rand(8, 8, dtype=dtypes[i % len(dtypes)], seed=i)
        p = torch.nn.Parameter(torch.empty_like(grad))
        p.grad = grad
        params.append(p)
    return params


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, torch.bfloat16)], ids=["fp32", "fp32+bf16"])
def test_the_blockwise_branch_dispatches_a_few_ops_per_dtype_group_however_many_leaves(
    blockwise_cpu, dtypes, norm_type
):
    counts = {}
    for n_leaves in (100, 10_000):
        params = _params(n_leaves, dtypes)
        want = reference_norm([p.grad for p in params], norm_type)
        with OpCounter() as ops:
            got = clip_grad_norm_(params, None, max_norm=1e30, norm_type=norm_type)
        counts[n_leaves] = ops.n
        assert_close_rel(float(got), want, 1e-6)
    assert counts[10_000] == counts[100], counts
    assert counts[10_000] <= 64, counts


def test_the_blockwise_branch_takes_every_leaf_whole_in_one_foreach_call(blockwise_cpu):
    leaves = [_rand(n, dtype=torch.float32, seed=n) for n in (3, 4097, 100_003, 1_200_001)]
    leaves.append(_rand(1500, 700, dtype=torch.float32, seed=1).t())
    norms, stats = local._traced(leaves, norm_kind(2.0), False)
    assert stats == [] and len(norms) == 1 and norms[0].shape == (len(leaves),)
    torch.testing.assert_close(norms[0], torch.stack([torch.linalg.vector_norm(t) for t in leaves]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_dtensor_shards_of_the_band_match_eager(dtype):
    """A DTensor's local shard can reach the row path with a symbolic size: no Python int is needed there."""
    sizes = (55_924, 65_536, 100_003)  # rows and a partial row; rows that tile; one of each dtype band
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))

        def grads() -> dict[str, DTensor]:
            return {f"w{n}": DTensor.from_local(_rand(n, dtype=dtype, seed=n), mesh, [Shard(0)]) for n in sizes}

        torch._dynamo.reset()
        compiled = torch.compile(lambda g: global_grad_norm(g, mesh), fullgraph=True)
        got, want = compiled(grads()), global_grad_norm(grads(), mesh)
        torch._dynamo.reset()
    # The fake all-reduce returns this rank's statistics: both are this shard's norm, computed two ways.
    assert_close_rel(float(got), float(want), 1e-6)
