"""torch.compile(fullgraph=True) traces the clip into one graph with one collective, on a fake process group.

Single process: ``tests._fake_pg.fake_world`` makes this process one rank of
an 8-, 64- or 512-rank world whose collectives complete without moving data,
which is all tracing needs. Every compile goes through a capturing backend
(dynamo's FX graph, then AOTAutograd's aten graph, run as ``aot_eager``),
so each case both runs and shows what it traced:

* every layout (plain tensors, FSDP ``Shard(0)``, PP×FSDP×TP with
  ``_StridedShard``, HSDP, an expert-parallel mesh, mixed dtypes, ``None``
  leaves) and every norm type compiles with ``fullgraph=True`` and gives the
  eager result;
* the aten graph holds one ``all_reduce`` and one ``wait_tensor`` and no host
  sync, at every world size;
* 100 steps with new gradients and a new 0-dim tensor ``max_norm`` compile
  once (a Python float ``max_norm`` is baked into the first graph; a new value
  recompiles once, with the float made a graph input);
* two ranks of an SPMD world trace the same graph, character for character;
  a world smaller than the process group (one pipeline stage) differs across
  stages only by the name of the group it reduces over.

The compiled clip is specialized to the DeviceMesh objects it sees (the
layout analysis runs once, at trace time, and dynamo guards those meshes by
identity), so, like a trainer's parameters, the test's grads keep their mesh
objects from step to step. Dynamo is reset between cases, and each fake world
is torn down after its test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils import _pytree as pytree

from ppclip_func import clip_grad_norm, clip_grad_norm_
from ppclip_func.torchtitan import clip_grad_norm_ as titan_clip_grad_norm_
from tests._fake_pg import fake_world

NORM_TYPES = (2.0, 1.0, 3.5, 0.0, math.inf, -math.inf)
# world size -> (mesh shape, dim names). The 3-D worlds have no dp_replicate
# dim, so their trees have no HSDP leaf; the 4-D ones do.
WORLDS: dict[int, tuple[tuple[int, ...], tuple[str, ...]]] = {
    8: ((2, 2, 2), ("pp", "dp_shard", "tp")),
    64: ((4, 4, 4), ("pp", "dp_shard", "tp")),
    512: ((8, 4, 4, 4), ("pp", "dp_replicate", "dp_shard", "tp")),
}
HSDP_WORLD_64 = ((2, 2, 4, 4), ("pp", "dp_replicate", "dp_shard", "tp"))
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d", "_c10d_functional_autograd")
HOST_SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::equal", "aten::is_nonzero")


# --- fake worlds and gradient trees ----------------------------------------------------------


@contextlib.contextmanager
def world_mesh(world_size: int, rank: int = 0, layout: tuple | None = None) -> Iterator[DeviceMesh]:
    """This process as ``rank`` of a fake world, with its world mesh; dynamo is reset on both sides."""
    shape, names = layout or WORLDS[world_size]
    torch._dynamo.reset()
    with fake_world(world_size, rank):
        try:
            yield init_device_mesh("cpu", shape, mesh_dim_names=names)
        finally:
            torch._dynamo.reset()


def _dtensor(local: torch.Tensor, mesh: DeviceMesh, placements: list, shape: tuple[int, ...]) -> DTensor:
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


@dataclasses.dataclass(frozen=True)
class LayoutMeshes:
    """The sub-meshes the layouts live on, sliced once, as a trainer's parameters hold them.

    The compiled clip is specialized to these objects (see docs/compile.md): a
    DTensor grad keeps its parameter's mesh object from step to step.
    """

    world: DeviceMesh
    fsdp: DeviceMesh
    fsdp_tp: DeviceMesh
    ep: DeviceMesh
    hsdp: DeviceMesh | None

    @classmethod
    def of(cls, world: DeviceMesh) -> LayoutMeshes:
        fsdp_tp = world["dp_shard", "tp"]
        n = fsdp_tp.size()
        # torchtitan-style expert mesh: the dp_shard x tp ranks re-split as (edp, ep).
        ep = fsdp_tp._flatten("dp_shard_tp")._unflatten(0, (2, n // 2), ("edp", "ep"))
        names = world.mesh_dim_names or ()
        hsdp = world["dp_replicate", "dp_shard"] if "dp_replicate" in names else None
        return cls(world=world, fsdp=world["dp_shard"], fsdp_tp=fsdp_tp, ep=ep, hsdp=hsdp)


def layout_trees(meshes: LayoutMeshes, seed: int) -> dict[str, Any]:
    """One gradient subtree per layout; the same shapes and meshes for every seed."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    n, t, ep = meshes.fsdp.size(), meshes.world["tp"].size(), meshes.ep
    trees: dict[str, Any] = {
        "plain": {"bias": randn(7), "scale": randn(())},
        "fsdp": {"w": _dtensor(randn(3, 5), meshes.fsdp, [Shard(0)], (3 * n, 5))},
        "pp_fsdp_tp": {
            # FSDP2 over TP on the same tensor dim: _StridedShard on dp_shard, Shard on tp.
            "wq": _dtensor(randn(2, 3), meshes.fsdp_tp, [_StridedShard(0, split_factor=t), Shard(0)], (2 * n * t, 3)),
            "wo": _dtensor(randn(4, 2), meshes.fsdp_tp, [Shard(0), Shard(1)], (4 * n, 2 * t)),
            "norm": _dtensor(randn(6), meshes.fsdp_tp, [Shard(0), Replicate()], (6 * n,)),
        },
        "ep": {"experts": _dtensor(randn(2, 3, 4), ep, [Shard(1), Shard(0)], (2 * ep.size(1), 3 * ep.size(0), 4))},
        "mixed": {
            "bf16": _dtensor(randn(3, 4, dtype=torch.bfloat16), meshes.fsdp, [Shard(0)], (3 * n, 4)),
            "fp16": randn(5, dtype=torch.float16),
            "fp64": _dtensor(randn(2, 2, dtype=torch.float64), meshes.fsdp_tp, [Replicate(), Shard(1)], (2, 2 * t)),
            "frozen": None,
            "layers": [randn(2, 2, dtype=torch.bfloat16), None, randn(0)],
        },
    }
    if meshes.hsdp is not None:
        trees["hsdp"] = {"w": _dtensor(randn(3, 2), meshes.hsdp, [Replicate(), Shard(0)], (3 * n, 2))}
    return trees


def by_path(tree: Any) -> dict[str, torch.Tensor]:
    """The tensor leaves of ``tree``, keyed by pytree path."""
    return {pytree.keystr(path): x for path, x in pytree.tree_flatten_with_path(tree)[0] if isinstance(x, torch.Tensor)}


def as_parameters(tree: Any) -> dict[str, torch.nn.Parameter]:
    """Parameters, keyed by pytree path, whose ``.grad`` are copies of the tensor leaves of ``tree``."""
    params = {k: torch.nn.Parameter(torch.zeros_like(x)) for k, x in by_path(tree).items()}
    for k, x in by_path(tree).items():
        params[k].grad = x.clone()
    return params


# --- capturing the graphs --------------------------------------------------------------------


class CaptureBackend:
    """A torch.compile backend that keeps dynamo's graph and the aten graph, then runs like aot_eager."""

    def __init__(self) -> None:
        self.dynamo: list[torch.fx.GraphModule] = []
        self.aten: list[torch.fx.GraphModule] = []
        self._pending: list[torch.fx.GraphModule] = []
        self._aot = aot_autograd(fw_compiler=self._keep_aten)

    def _keep_aten(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        self._pending.append(gm)
        return make_boxed_func(gm.forward)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        # Kept only once compiled: dynamo may abandon an attempt and restart
        # its analysis (e.g. to turn a Python float into a tensor input).
        self._pending = []
        compiled = self._aot(gm, example_inputs)
        self.dynamo.append(gm)
        self.aten.extend(self._pending)
        return compiled

    @property
    def frames(self) -> int:
        return len(self.dynamo)


def aten_ops(gm: torch.fx.GraphModule) -> list[str]:
    """``namespace::name`` of every op the graph calls, in order."""
    return [n.target.name() for n in gm.graph.nodes if n.op == "call_function" and hasattr(n.target, "name")]


def collectives(gm: torch.fx.GraphModule) -> tuple[list[str], list[str]]:
    """The graph's collective ops and its waits."""
    ops = [op for op in aten_ops(gm) if op.split("::")[0] in COLLECTIVE_NAMESPACES]
    waits = [op for op in ops if op.endswith("wait_tensor")]
    return [op for op in ops if op not in waits], waits


def assert_one_graph_one_collective(backend: CaptureBackend, expected: int = 1) -> None:
    assert backend.frames == 1, f"expected one graph, dynamo produced {backend.frames}"
    assert len(backend.aten) == 1
    gm = backend.aten[0]
    colls, waits = collectives(gm)
    assert len(colls) == expected and len(waits) == expected, f"collectives {colls}, waits {waits}"
    if expected:
        assert colls == ["_c10d_functional::all_reduce"], colls
    syncs = [op for op in aten_ops(gm) if op in HOST_SYNC_OPS]
    assert not syncs, f"host syncs in the graph: {syncs}"


def graph_constants(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    return {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}


def assert_same_result(got: Any, want: Any) -> None:
    """Compiled (aot_eager) and eager agree within the precision promise.

    Eager on CPU reduces large and low-precision leaves through a scratch
    buffer, the traced graph with whole-leaf and row-wise norms, so the norms
    may differ in their last bits (within 1e-6 relative), and a clipped grad
    then by at most one rounding in its dtype.
    """
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec
    for a, b in zip(got_leaves, want_leaves):
        if b is None:
            assert a is None
            continue
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
        if isinstance(b, DTensor):
            assert a.placements == b.placements and a.device_mesh == b.device_mesh
            a, b = a.to_local(), b.to_local()
        rtol = max(1e-6, 2 * torch.finfo(b.dtype).eps)
        torch.testing.assert_close(a, b, rtol=rtol, atol=0, equal_nan=True)


def compile_pure(mesh: DeviceMesh | None, norm_type: float) -> tuple[Callable, CaptureBackend]:
    backend = CaptureBackend()

    def step(grads: Any, max_norm: torch.Tensor) -> Any:
        return clip_grad_norm(grads, mesh, max_norm, norm_type)

    return torch.compile(step, backend=backend, fullgraph=True), backend


def compile_inplace(mesh: DeviceMesh | None, norm_type: float) -> tuple[Callable, CaptureBackend]:
    backend = CaptureBackend()

    def step(params: dict[str, torch.nn.Parameter], max_norm: torch.Tensor) -> torch.Tensor:
        return clip_grad_norm_(params, mesh, max_norm, norm_type)

    return torch.compile(step, backend=backend, fullgraph=True), backend


def check_pure(mesh: DeviceMesh | None, grads: Any, norm_type: float, collectives_expected: int = 1) -> None:
    max_norm = torch.tensor(0.25)
    compiled, backend = compile_pure(mesh, norm_type)
    got = compiled(grads, max_norm)
    assert_one_graph_one_collective(backend, collectives_expected)
    assert_same_result(got, clip_grad_norm(grads, mesh, max_norm, norm_type))
    torch._dynamo.reset()


def check_inplace(mesh: DeviceMesh, grads: Any, norm_type: float) -> None:
    max_norm = torch.tensor(0.25)
    compiled_params, eager_params = as_parameters(grads), as_parameters(grads)
    compiled, backend = compile_inplace(mesh, norm_type)
    total = compiled(compiled_params, max_norm)
    assert_one_graph_one_collective(backend)
    assert_same_result(total, clip_grad_norm_(eager_params, mesh, max_norm, norm_type))
    assert_same_result({k: p.grad for k, p in compiled_params.items()}, {k: p.grad for k, p in eager_params.items()})
    torch._dynamo.reset()


# --- 1 + 2: every layout, every norm type, one collective, no host sync ----------------------


@pytest.mark.parametrize("world_size", sorted(WORLDS))
def test_fullgraph_all_layouts_every_norm_type_one_all_reduce(world_size):
    with world_mesh(world_size, rank=world_size // 3) as mesh:
        grads = layout_trees(LayoutMeshes.of(mesh), seed=world_size)
        for norm_type in NORM_TYPES:
            check_pure(mesh, grads, norm_type)
        for norm_type in (2.0, math.inf):
            check_inplace(mesh, grads, norm_type)


def test_fullgraph_each_layout_alone_one_all_reduce():
    with world_mesh(64, rank=37, layout=HSDP_WORLD_64) as mesh:
        trees = layout_trees(LayoutMeshes.of(mesh), seed=1)
        assert set(trees) == {"plain", "fsdp", "pp_fsdp_tp", "hsdp", "ep", "mixed"}
        for tree in trees.values():
            check_pure(mesh, tree, 2.0)
        # FSDP-only, as torchtitan hands it over: mesh=None reduces over the leaves' own mesh.
        check_pure(None, trees["fsdp"], 2.0)


@pytest.mark.parametrize(
    "options",
    [
        {"groups": {"experts": "ep", "fsdp": lambda path: "fsdp" in path}},
        {"tied": {"plain": 2}},
        {"nonfinite": "zero"},
        {"overflow_safe": True},
    ],
    ids=["groups", "tied", "nonfinite_zero", "overflow_safe"],
)
def test_fullgraph_with_each_option_still_one_all_reduce(options):
    with world_mesh(64, rank=9) as mesh:
        grads = layout_trees(LayoutMeshes.of(mesh), seed=2)
        backend = CaptureBackend()

        def step(grads: Any, max_norm: torch.Tensor) -> Any:
            return clip_grad_norm(grads, mesh, max_norm, **options)

        got = torch.compile(step, backend=backend, fullgraph=True)(grads, torch.tensor(0.25))
        assert_one_graph_one_collective(backend)
        assert_same_result(got, clip_grad_norm(grads, mesh, torch.tensor(0.25), **options))


def test_fullgraph_plain_tensors_without_a_mesh_needs_no_collective():
    grads = {"w": torch.randn(4, 3), "b": None, "h": [torch.randn(5, dtype=torch.bfloat16)]}
    torch._dynamo.reset()
    check_pure(None, grads, 2.0, collectives_expected=0)


# --- 3: no recompiles ------------------------------------------------------------------------


def test_hundred_steps_with_new_grads_and_tensor_max_norm_compile_once():
    with world_mesh(64, rank=5) as mesh:
        pure, pure_backend = compile_pure(mesh, 2.0)
        inplace, inplace_backend = compile_inplace(mesh, 2.0)
        meshes = LayoutMeshes.of(mesh)
        coefs = set()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for step in range(100):
                grads = layout_trees(meshes, seed=step)
                max_norm = torch.tensor(0.5 + 0.02 * step)
                clipped, total = pure(grads, max_norm)
                want_clipped, want_total = clip_grad_norm(grads, mesh, max_norm)
                assert_same_result((clipped, total), (want_clipped, want_total))
                coefs.add(float(torch.clamp(max_norm / (total + 1e-6), max=1.0)))

                params = as_parameters(grads)
                assert_same_result(inplace(params, max_norm), want_total)
                assert_same_result({k: p.grad for k, p in params.items()}, by_path(want_clipped))
        assert pure_backend.frames == 1 and inplace_backend.frames == 1
        assert len(coefs) == 100, "max_norm and the grads changed every step, so must the coefficient"


def test_python_float_max_norm_is_specialized_then_made_dynamic_once():
    with world_mesh(8) as mesh:
        backend = CaptureBackend()

        def step(grads: Any, max_norm: float) -> Any:
            return clip_grad_norm(grads, mesh, max_norm)

        compiled = torch.compile(step, backend=backend, fullgraph=True)
        grads = layout_trees(LayoutMeshes.of(mesh), seed=0)
        frames = []
        for max_norm in (0.5, 0.5, 0.25, 0.125, 0.0625):
            assert_same_result(compiled(grads, max_norm), clip_grad_norm(grads, mesh, max_norm))
            frames.append(backend.frames)
        # The first graph bakes 0.5 in; the first new value recompiles once with
        # max_norm as a symbolic input (dynamo's automatic dynamic), then no more.
        assert frames == [1, 1, 2, 2, 2]
        inputs = [[n.name for n in gm.graph.nodes if n.op == "placeholder"] for gm in backend.dynamo]
        assert "l_max_norm_" not in inputs[0] and "l_max_norm_" in inputs[1]


# --- 6: the same graph on every rank ---------------------------------------------------------


def _trace_at(world_size: int, rank: int, stage_world: bool = False) -> tuple[str, str, dict, str]:
    """Traces the clip as ``rank``: graph codes, aten constants, and the reduced-over group's name.

    ``stage_world``: reduce over one pipeline stage (``mesh["dp_shard", "tp"]``)
    instead of the whole world mesh.
    """
    with world_mesh(world_size, rank) as mesh:
        meshes = LayoutMeshes.of(mesh)
        trees = layout_trees(meshes, seed=0)
        world, grads = (meshes.fsdp_tp, trees["pp_fsdp_tp"]) if stage_world else (mesh, trees)
        # A multi-dim world smaller than the process group reduces over its flattened group, made up front.
        group = world._flatten().get_group().group_name if stage_world else dist.group.WORLD.group_name
        compiled, backend = compile_pure(world, 2.0)
        compiled(grads, torch.tensor(1.0))
        assert_one_graph_one_collective(backend)
        return backend.dynamo[0].code, backend.aten[0].code, graph_constants(backend.aten[0]), group


@pytest.mark.parametrize(("world_size", "ranks"), [(64, (0, 45)), (512, (7, 300))])
def test_every_rank_of_the_world_mesh_traces_the_same_graph(world_size, ranks):
    (dyn_a, aten_a, const_a, group_a), (dyn_b, aten_b, const_b, group_b) = (_trace_at(world_size, r) for r in ranks)
    assert dyn_a == dyn_b
    assert aten_a == aten_b
    assert group_a == group_b and "all_reduce.default(" in aten_a and repr(group_a) in aten_a
    assert const_a.keys() == const_b.keys()
    for name in const_a:
        assert torch.equal(const_a[name], const_b[name]), name


def test_a_sub_mesh_world_differs_across_groups_only_by_the_group_name():
    # mesh["dp_shard", "tp"] as the world: each pipeline stage is its own 16-rank
    # group. Ranks 3 and 12 share stage 0; rank 20 is in stage 1. Reducing over
    # a different set of ranks needs a different group, and funcol names it in
    # the graph; nothing else may differ.
    stage0_a, stage0_b, stage1 = (_trace_at(64, r, stage_world=True) for r in (3, 12, 20))
    assert stage0_a[3] == stage0_b[3] != stage1[3]
    assert stage0_a[:2] == stage0_b[:2]
    for a, b in zip(stage0_a[:2], stage1[:2]):
        assert a != b
        assert a.replace(repr(stage0_a[3]), "GROUP") == b.replace(repr(stage1[3]), "GROUP")


# --- 5: torchtitan's meshes: the 1-D root mesh with pp_mesh, and the drop-in --------------------


@pytest.mark.parametrize("world_size", [8, 512])
def test_pp_mesh_on_the_1d_root_mesh_compiles_to_one_graph_one_all_reduce(world_size):
    with fake_world(world_size, world_size - 1):
        root = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))
        full = root._unflatten(0, (2, world_size // 4, 2), ("pp", "dp_shard", "tp"))
        stage = full["dp_shard", "tp"]
        grads = {
            "w": _dtensor(torch.randn(4, 8), stage, [Shard(0), Replicate()], (4 * world_size // 4, 8)),
            "b": torch.randn(5),
        }
        pp_mesh = full["pp"]
        for mesh in (root, None):
            backend = CaptureBackend()

            def step(grads: Any, max_norm: torch.Tensor, mesh: DeviceMesh | None = mesh) -> Any:
                return clip_grad_norm(grads, mesh, max_norm, pp_mesh=pp_mesh)

            got = torch.compile(step, backend=backend, fullgraph=True)(grads, torch.tensor(0.25))
            assert_one_graph_one_collective(backend)
            assert_same_result(got, clip_grad_norm(grads, mesh, torch.tensor(0.25), pp_mesh=pp_mesh))
            torch._dynamo.reset()

        # torchtitan's call, through the drop-in: no world mesh at all, the stages from pp_mesh.
        backend = CaptureBackend()
        dropin = torch.compile(titan_clip_grad_norm_, backend=backend, fullgraph=True)
        total = dropin(list(as_parameters(grads).values()), 0.25, foreach=True, pp_mesh=pp_mesh)
        assert_one_graph_one_collective(backend)
        assert_same_result(total, got[1])
        torch._dynamo.reset()
