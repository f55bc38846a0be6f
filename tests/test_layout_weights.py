"""Layout weights count every element of the model gradient exactly once, at any scale.

No processes are spawned: every rank of a random world mesh (up to 4 dims,
up to 512 ranks, shuffled rank numbering) is simulated. Each rank's local
shard is cut from the full tensor by torch's own DTensor placement splitters
(``Shard``/``_StridedShard._split_tensor``, uneven shards included), weighed
by ``1 / replica_count`` exactly as the clip weighs it, and the weighted sum
over all ranks must equal the full tensor's sum once per distinct copy of
the parameter in the model (once in all, for a parameter tied across
stages). Max and min norms are checked too: the extremum over all ranks'
shards is the full tensor's. Hypothesis prints the failing layout and the
blob to reproduce it.
"""

from __future__ import annotations

import math
import random

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ppclip_func._core.layout import replica_count, world_from_table


def _coords(shape):
    coords = [()]
    for n in shape:
        coords = [(*c, i) for c in coords for i in range(n)]
    return coords


@st.composite
def layouts(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 8]), min_size=ndim, max_size=ndim)))
    if math.prod(shape) > 512:
        shape = tuple(min(n, 2) for n in shape)
    pp_dims = tuple(sorted(draw(st.sets(st.integers(0, ndim - 1), max_size=2))))
    # The leaf's mesh: any subset of world dims, in order (pipeline dims included:
    # a leaf mesh spanning stages is a parameter shared by them).
    leaf_dims = tuple(sorted(draw(st.sets(st.integers(0, ndim - 1)))))
    tshape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    placements = []
    for _ in leaf_dims:
        kind = draw(st.sampled_from(["replicate", "shard", "shard", "partial"]))
        if kind == "partial":
            placements.append(Partial(draw(st.sampled_from(["sum", "avg"]))))
        else:
            placements.append(Replicate() if kind == "replicate" else Shard(draw(st.integers(0, len(tshape) - 1))))
    # FSDP2 x TP: when an earlier mesh dim shards the same tensor dim as a later
    # one, torch uses _StridedShard on the earlier one (right-to-left order).
    if draw(st.booleans()):
        for i, p in enumerate(placements):
            later = [j for j in range(i + 1, len(placements)) if placements[j] == p and isinstance(p, Shard)]
            if isinstance(p, Shard) and later:
                factor = math.prod(shape[leaf_dims[j]] for j in later)
                placements[i] = _StridedShard(p.dim, split_factor=factor)
                break
    # Tied: the parameter sits on the first `tied` pipeline stages only (its grads
    # summed across them), declared as held by that many stages.
    n_stages = math.prod(shape[d] for d in pp_dims)
    spans_pp = any(d in pp_dims for d in leaf_dims)
    tied = 1 if spans_pp else draw(st.integers(1, n_stages))
    seed = draw(st.integers(0, 2**32 - 1))
    return shape, pp_dims, leaf_dims, tshape, tuple(placements), tied, seed


def _rank_at(table, coord):
    r = table
    for v in coord:
        r = r[v]
    return r


def _local_shard(full, leaf_shape, coord, placements):
    local = full
    for n, c, p in zip(leaf_shape, coord, placements):
        if isinstance(p, Shard | _StridedShard):
            chunks, _ = p._split_tensor(local, n, with_padding=False)
            local = chunks[c]
    return local


@settings(max_examples=500, deadline=None, print_blob=True)
@given(layout=layouts(), norm_p=st.sampled_from([2.0, 1.0, 3.5, 0.0, math.inf, -math.inf]))
def test_weighted_sum_over_all_ranks_counts_each_element_once(layout, norm_p):
    shape, pp_dims, leaf_dims, tshape, placements, tied, seed = layout
    n = math.prod(shape)
    rng = random.Random(seed)
    ranks = list(range(n))
    rng.shuffle(ranks)
    table = torch.tensor(ranks).reshape(shape).tolist()
    world = world_from_table(None, table, shape, pp_dims, group_name=None)
    full = torch.randn(tshape, generator=torch.Generator().manual_seed(seed % 2**31), dtype=torch.float64)
    full[full.abs() < 0.2] = 0.0

    def stat(x):
        if math.isinf(norm_p):  # max/min need no weights: replicas repeat values
            return float(x.abs().max() if norm_p > 0 else x.abs().min()) if x.numel() else None
        return float((x != 0).sum()) if norm_p == 0 else float(x.abs().pow(norm_p).sum())

    leaf_shape = tuple(shape[d] for d in leaf_dims)
    weighted = 0.0
    extrema = []
    holders = None
    stages = sorted(set(world.rank_stage.values()))
    for coord in _coords(shape):
        if tied > 1 and world.rank_stage[_rank_at(table, coord)] not in stages[:tied]:
            continue  # a stage that does not hold the tied parameter
        # This rank's leaf mesh: the ranks that share its coordinates off the leaf's dims.
        members = []
        for sub in _coords(leaf_shape):
            c = list(coord)
            for d, v in zip(leaf_dims, sub):
                c[d] = v
            members.append(_rank_at(table, c))
        if leaf_dims:
            if any(p.is_partial() for p in placements):
                # Partial grads are refused as they are; partial="reduce" makes them Replicate first.
                with pytest.raises(ValueError, match="has a Partial placement"):
                    replica_count(world, members, leaf_shape, placements)
                placements = tuple(Replicate() if p.is_partial() else p for p in placements)
            copies = replica_count(world, members, leaf_shape, placements)
            local = _local_shard(full, leaf_shape, tuple(coord[d] for d in leaf_dims), placements)
        else:  # a plain tensor: replicated over the rank's pipeline stage
            copies = world.stage_size
            local = full
        if math.isinf(norm_p):
            extrema.append(stat(local))
            continue
        weighted += stat(local) / (copies * tied)
        n_stages_spanned = len({world.rank_stage[r] for r in members}) if leaf_dims else 1
        holders = world.stage_size * n_stages_spanned
    layout_str = f"mesh {shape}, pp dims {pp_dims}, leaf dims {leaf_dims}, {placements}, tied {tied}, tensor {tshape}"
    if math.isinf(norm_p):
        pick = max if norm_p > 0 else min
        assert pick(e for e in extrema if e is not None) == stat(full), layout_str
        return
    distinct_copies_of_parameter = 1 if tied > 1 else n // holders
    expected = distinct_copies_of_parameter * stat(full)
    assert weighted == pytest.approx(expected, rel=1e-12, abs=1e-12), layout_str


def test_fsdp_tp_example_by_hand():
    # World (pp=2, dp=2, tp=2); a weight sharded on dp (strided) and tp: one copy per stage.
    world = world_from_table(None, torch.arange(8).reshape(2, 2, 2).tolist(), (2, 2, 2), (0,), None)
    assert world.stage_size == 4
    assert replica_count(world, [0, 1, 2, 3], (2, 2), (_StridedShard(0, split_factor=2), Shard(0))) == 1
    # A norm weight replicated over tp, sharded over dp: 2 copies.
    assert replica_count(world, [4, 5, 6, 7], (2, 2), (Shard(0), Replicate())) == 2
    # An FSDP-only leaf on the dp submesh (implicitly replicated over tp): 2 copies.
    assert replica_count(world, [0, 2], (2,), (Shard(0),)) == 2


def test_partial_placement_is_a_clear_error():
    world = world_from_table(None, [[0, 1]], (1, 2), (), None)
    with pytest.raises(ValueError, match=r"has a Partial placement .*partial='reduce'"):
        replica_count(world, [0, 1], (2,), (Partial("sum"),))


def test_foreign_mesh_is_a_clear_error():
    world = world_from_table(None, [[0, 1]], (1, 2), (), None)
    with pytest.raises(ValueError, match=r"ranks \[5\] are not in the world mesh"):
        replica_count(world, [1, 5], (2,), (Shard(0),))
