"""Bad input: a clear error that names the leaf or the argument, raised before any collective.

Every check depends only on static facts (types, dtypes, devices,
placements, meshes) and runs before the statistics are reduced. A rank that
fails a check about its own leaves still joins the one all-reduce (with
poisoned statistics) before it raises, so no peer is left waiting; only a
mesh that cannot be reduced over at all (wrong type, this rank not in it)
raises with no collective. The distributed half of that promise is in
test_robustness_distributed.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ppclip_func import clip_grad_norm, clip_grad_norm_, clip_grads_with_norm, global_grad_norm
from tests._collectives import CollectiveCounter, steady_count
from tests._fake_pg import fake_world


@pytest.mark.parametrize(
    "leaf, match",
    [
        (torch.ones(3, dtype=torch.int64), r"leaf \['layers'\]\[1\] has dtype torch.int64"),
        (torch.ones(3, dtype=torch.bool), r"leaf \['layers'\]\[1\] has dtype torch.bool"),
        (torch.ones(3, dtype=torch.complex64), r"leaf \['layers'\]\[1\] has dtype torch.complex64"),
        (3.0, r"leaf \['layers'\]\[1\] must be a torch.Tensor, a DTensor or None, got float"),
    ],
)
def test_non_float_leaf_is_a_type_error_naming_the_path(leaf, match):
    grads = {"layers": [torch.ones(2), leaf]}
    for call in (
        lambda: clip_grad_norm(grads, None, 1.0),
        lambda: global_grad_norm(grads, None),
        lambda: clip_grads_with_norm(grads, 1.0, torch.tensor(1.0)),
    ):
        with pytest.raises(TypeError, match=match):
            call()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_norm": -1.0}, ValueError, "max_norm must be >= 0, got -1.0"),
        ({"max_norm": math.nan}, ValueError, "max_norm must be >= 0, got nan"),
        ({"max_norm": "1"}, TypeError, "max_norm must be a number or a 0-dim tensor"),
        ({"max_norm": torch.ones(2)}, ValueError, r"max_norm must be a number or a 0-dim tensor, got shape \(2,\)"),
        ({"norm_type": "fro"}, TypeError, "norm_type must be a real number"),
        ({"norm_type": -2.0}, ValueError, "norm_type must be p > 0, 0, inf or -inf, got -2.0"),
        ({"norm_type": math.nan}, ValueError, "norm_type must be p > 0, 0, inf or -inf"),
        ({"eps": -1e-6}, ValueError, "eps must be a number >= 0"),
        ({"nonfinite": "ignore"}, ValueError, "nonfinite must be one of"),
        ({"partial": "allow"}, ValueError, "partial must be one of"),
        ({"groups": ["a"]}, TypeError, "groups must map labels"),
        ({"groups": {"a": 3}}, TypeError, r"groups\['a'\] must be a name pattern or a callable"),
        ({"tied": {"emb": 0}}, ValueError, r"tied\['emb'\] must be the number of stages"),
        ({"pp_dim": "pp"}, ValueError, "pp_dim='pp' was given but mesh is None"),
    ],
)
def test_bad_argument_names_the_argument(kwargs, error, match):
    args = {"max_norm": 1.0, "norm_type": 2.0, **kwargs}
    grads = [torch.ones(3)]
    with pytest.raises(error, match=match):
        clip_grad_norm(grads, None, args.pop("max_norm"), args.pop("norm_type"), **args)


def test_mesh_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="mesh must be a DeviceMesh or None, got str"):
        clip_grad_norm([torch.ones(2)], "world", 1.0)


def test_leaves_on_different_devices_is_a_value_error_naming_both():
    grads = {"a": torch.ones(2), "b": torch.ones(2, device="meta")}
    with pytest.raises(ValueError, match=r"leaves \['a'\] and \['b'\] are on different devices \(cpu and meta\)"):
        global_grad_norm(grads, None)


def test_generator_is_consumed_once_and_really_clipped():
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    for p in params:
        p.grad = torch.full((2,), 10.0)
    clip_grad_norm_((p for p in params), None, 1.0)
    assert all(float(p.grad.abs().max()) < 1.0 for p in params), "a generator must not silently skip clipping"


def test_non_tensor_parameter_is_a_type_error():
    with pytest.raises(TypeError, match="parameters must be tensors, got str"):
        clip_grad_norm_(["w"], None, 1.0)


def test_total_norm_must_be_a_0_dim_tensor():
    with pytest.raises(TypeError, match="total_norm must be a 0-dim tensor"):
        clip_grads_with_norm([torch.ones(2)], 1.0, 2.0)


# --- with a device mesh (fake process group: one process, any number of ranks) ---


def test_pp_dim_not_in_mesh_is_a_value_error():
    with fake_world(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
        with pytest.raises(ValueError, match=r"pp_dim names \['stage'\] that the mesh does not have"):
            global_grad_norm([torch.ones(2)], mesh, pp_dim="stage")


def test_mesh_without_this_rank_is_a_value_error():
    with fake_world(8, rank=0):
        other = DeviceMesh("cpu", [4, 5, 6, 7])
        with (
            CollectiveCounter() as counter,
            pytest.raises(ValueError, match=r"this rank \(0\) is not part of the mesh"),
        ):
            global_grad_norm([torch.ones(2)], other)
        assert counter.count == 0


def test_dtensor_on_a_foreign_mesh_is_a_value_error_naming_the_leaf():
    with fake_world(8, rank=1):
        world = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("pp", "dp"))
        world._flatten()  # a world smaller than the process group needs its group made up front
        foreign = DeviceMesh("cpu", [1, 5])
        leaf = DTensor.from_local(torch.ones(2), foreign, [Shard(0)], run_check=False)
        with (
            CollectiveCounter() as counter,
            pytest.raises(ValueError, match=r"leaf \['emb'\].*\[5\].*not in the world"),
        ):
            global_grad_norm({"emb": leaf}, world)
        assert steady_count(counter) == 1, "a failing rank still joins the one collective, so no peer waits"


@pytest.mark.parametrize("reduce_op", ["sum", "avg", "max", "min"])
def test_partial_placement_is_rejected_by_default_naming_the_leaf(reduce_op):
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        leaf = DTensor.from_local(torch.ones(3), mesh, [Partial(reduce_op)], run_check=False)
        with CollectiveCounter() as counter, pytest.raises(ValueError, match=r"leaf \['norm'\] has a Partial"):
            clip_grad_norm({"norm": leaf}, mesh, 1.0)
        assert steady_count(counter) == 1, "a failing rank still joins the one collective, so no peer waits"


@pytest.mark.parametrize("reduce_op", ["max", "min"])
def test_partial_max_min_cannot_be_reduced(reduce_op):
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        leaf = DTensor.from_local(torch.ones(3), mesh, [Partial(reduce_op)], run_check=False)
        with (
            CollectiveCounter() as counter,
            pytest.raises(ValueError, match=rf"leaf \['norm'\] has placement .*{reduce_op}"),
        ):
            clip_grad_norm({"norm": leaf}, mesh, 1.0, partial="reduce")
        assert steady_count(counter) == 1, "a failing rank still joins the one collective, so no peer waits"


@pytest.mark.parametrize("tree", [[], {}, None, {"a": None}])
def test_empty_tree_with_a_mesh_has_norm_zero_and_still_joins_the_one_collective(tree):
    with fake_world(8, rank=3):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
        with CollectiveCounter() as counter:
            clipped, total = clip_grad_norm(tree, mesh, 1.0)
        assert steady_count(counter) == 1, counter.ops
        assert float(total) == 0.0 and clipped == tree


def test_replicate_dtensor_on_world_with_no_pp_is_weighted_by_its_replicas():
    # One process cannot check cross-rank sums, but the fake all-reduce returns
    # this rank's own contribution, which shows the weight: 1/4 of |x|^2.
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        leaf = DTensor.from_local(torch.full((4,), 2.0), mesh, [Replicate()], run_check=False)
        assert float(global_grad_norm([leaf], mesh)) == pytest.approx(math.sqrt(16.0 / 4))


def test_an_exhausted_generator_of_parameters_warns():
    model = torch.nn.Linear(2, 1)
    for p in model.parameters():
        p.grad = torch.full_like(p, 10.0)
    params = model.parameters()
    list(params)  # consumed earlier, e.g. by an optimizer built from the same generator
    with pytest.warns(UserWarning, match="empty iterator .* no gradient of this rank will be clipped"):
        total = clip_grad_norm_(params, None, 1.0)
    assert float(total) == 0.0


def test_a_list_of_parameters_without_grads_does_not_warn(recwarn):
    clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], None, 1.0)
    assert not recwarn.list


def test_float8_grads_are_a_type_error_naming_the_leaf():
    with pytest.raises(TypeError, match=r"leaf \['f8'\] has dtype torch.float8_e5m2; only float16"):
        global_grad_norm({"f8": torch.ones(2).to(torch.float8_e5m2)}, None)
