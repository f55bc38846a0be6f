"""Measuring the global norm: from a gradient pytree to the one collective and back.

Every public form goes through :func:`measure` (by way of ``_clip.path.run``):
read the gradients, check them, weigh each leaf by its layout, reduce the
weighted local statistics in one all-reduce, and decode the result. Any
failure before the collective still joins it (``_core.failure``), so no peer
waits for a rank that raised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .._base.devices import constant
from .agreement import (
    Disagreement,
    carries_state,
    check_call,
    host_entries,
    state_entries,
    states_agree,
)
from .annotations import group_indices, tied_stages
from .collective import all_reduce_statistics, mesh_device, reduce_partial, world_of
from .failure import release
from .layout import World, count_copies, pipeline_stages, resolve_world
from .norms import ABSENT, HAS_ELEMENT, HAS_LEAF, NormKind
from .param_norms import leaf_slots
from .setup import OPTION_FIELDS, GroupNorms, NormOptions, check_norm_options, static_options
from .statistics import STAT_DTYPE, leaf_statistics, local_statistics
from .tree import Leaves, flatten_grads

__all__: list[str] = []


@dataclasses.dataclass(frozen=True)
class Measured:
    """A measured norm: the leaves it read, the total, each group's norm and each parameter's (if asked).

    ``reduced`` is the all-reduced statistics vector itself (``NormKind.encode``'s
    layout: ``entries`` statistics, for the groups, the leaves in none and
    the parameters; then their levels; then, with an adaptive state, its
    fingerprint's entries), for a capability that combines entries of its
    own (a total over some groups).
    ``sums`` is the all-reduced sum of every rank's ``sums`` vector (the
    step's other statistics), where :func:`measure` was given one.
    ``agree`` (with an adaptive state, where the stop on a disagreement may
    come after the scaling: on CUDA, or compiled) is whether every rank held
    the same state; the caller makes its step a no-op where it is false.
    """

    leaves: Leaves
    total: torch.Tensor
    per_group: dict[str, torch.Tensor]
    per_param: torch.Tensor | None
    reduced: torch.Tensor
    agree: torch.Tensor | None
    entries: int
    sums: torch.Tensor | None = None

    def norms(self, with_groups: bool) -> torch.Tensor | tuple[torch.Tensor, GroupNorms]:
        """Returns the public result: the total, and the groups' norms if asked for."""
        return (self.total, self.per_group) if with_groups else self.total


def measure(
    read_grads: Callable[[], Any],
    given: Any,
    what: str,
    mesh: DeviceMesh | None,
    kind: NormKind,
    opts: NormOptions,
    state: tuple[torch.Tensor, ...] | None = None,
    sums: Callable[[], torch.Tensor] | None = None,
) -> Measured:
    """Reads and flattens the gradients and measures the total and each group's norm, with one collective.

    ``sums``, with ``opts.sums`` entries and a sum-type norm, makes this
    rank's other statistics (a float64 vector of ``opts.sums`` values, on
    the statistics' device), summed over the ranks in the same collective.

    Exactly one statistics collective is issued, on every rank of the world,
    whether or not this rank's input is valid: a rank that fails before the
    collective, for any reason (a bad leaf on one pipeline stage only, a
    kernel that rejects its dtype), first joins the collective with poisoned
    statistics (``_core.failure.release``), then raises. Its peers never wait
    for it; they get a NaN norm.

    Every rank checks that all ranks pass the same options (``_core.agreement``: a
    gather the first time a configuration is seen, nothing after): with a
    ``mesh``, first of all; with ``mesh=None``, once the leaves have named
    the world, and a rank that fails before that takes part in the check
    from ``_core.failure.release``. An adaptive ``state`` (a
    ``ClipState`` or ``AdaGCState``) rides in the one collective as a
    fingerprint; :attr:`Measured.agree` says whether every rank held the same.
    """
    checked: list[bool] = [False]
    traced = torch.compiler.is_compiling()

    def options() -> dict[str, Any]:
        return static_options(kind.p, opts, state)

    def agree(world: World) -> None:
        # Traced, no key: the check runs at trace time (dynamo cannot trace an attrgetter on a dataclass).
        key = None if traced else (kind.p, type(state), *OPTION_FIELDS(opts))
        check_call(world, key, options, opts.tied)
        checked[0] = True

    known = world_of(mesh, [], opts.pp_dim, opts.pp_mesh) if mesh is not None else None
    if known is not None:
        agree(known)  # else the clip raises why, on every rank of that mesh alike
    try:
        leaves = flatten_grads(read_grads(), what)
        # With mesh=None the leaves name the world: checked there, before partial="reduce"'s collectives.
        world, stats, labels = _local_part(leaves, mesh, kind, opts, agree if mesh is None else None, known)
        extra = _sums(sums, opts.sums, kind, stats.device)
    except Disagreement:
        raise  # every rank raises it, before any other collective
    except Exception:
        # A rank that fails before its options check still takes part in it (its peers may be in the
        # gather), then in the statistics all-reduce.
        release(mesh, given, kind, opts, state, None if checked[0] else options())
        raise
    n, entries = len(labels) + 1, stats.numel() // 2
    if extra is not None:
        stats = torch.cat([stats, extra])  # between the norms' entries and the state's, read from the end
    with_state = state is not None and carries_state(world)
    if state is not None and with_state:
        # The state's fingerprint rides at the end of the vector; eagerly, from a CPU state, it is taken
        # on the host (own: the values), else by tensor ops.
        own = None if traced else host_entries(state, kind)
        mine = state_entries(state, kind, stats, own)
        stats = torch.cat([stats, mine])
    # Waited for at once, in eager mode: everything after reads it, and every op on the collective's
    # AsyncCollectiveTensor would go through its Python __torch_dispatch__.
    reduced = _plain(all_reduce_statistics(stats, kind, world))
    per_group = bool(labels) or opts.params is not None
    per_entry, total = kind.decode(reduced, per_group=per_group, n_total=n, n=entries)
    same_state = states_agree(reduced, mine, total, kind, world, type(state), own) if with_state else None
    # Float64, as the reduced statistics: every rank holds these bits, whatever leaves it holds (a
    # stage's own dtypes would differ between stages), and a float64 model keeps a float64 norm.
    # per_group (labels or params) means per_entry is not None.
    groups = {label: per_entry[i] for i, label in enumerate(labels)} if labels and per_entry is not None else {}
    per_param = per_entry[n:] if opts.params is not None and per_entry is not None else None
    summed = reduced[2 * entries : 2 * entries + opts.sums] if extra is not None else None
    return Measured(leaves, total, groups, per_param, reduced, same_state, entries, summed)


def _sums(make: Callable[[], torch.Tensor] | None, n: int, kind: NormKind, device: torch.device) -> torch.Tensor | None:
    """This rank's other statistics for the collective: ``n`` float64 values, or ``None``.

    The form refuses a norm that is not summed before any collective (``_clip.step``); here, its invariants.
    """
    assert (make is None) == (n == 0), "NormOptions.sums says how many entries the call's sums make"
    if make is None:
        return None
    assert kind.op == "sum", "other statistics ride a summed vector only"
    values = make()
    assert values.shape == (n,) and values.dtype == STAT_DTYPE, (values.dtype, values.shape)
    return values.to(device)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: in eager mode the collective returns an ``AsyncCollectiveTensor``, which
    waits when first read; nothing in the clip can overlap with it, so it is waited for at once.
    (Traced, there is no such wrapper.)"""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _local_part(
    leaves: Leaves,
    mesh: DeviceMesh | None,
    kind: NormKind,
    opts: NormOptions,
    on_world: Callable[[World], None] | None = None,
    known: World | None = None,
) -> tuple[World, torch.Tensor, list[str]]:
    """Returns the world, this rank's encoded statistics and the group labels; no collective but ``partial``'s.

    ``on_world`` is called with the world as soon as it is known, before ``partial``'s collectives.
    ``known`` is the world as :func:`world_of` resolved it from ``mesh``, if the caller has (a world of a
    ``mesh`` does not depend on the leaves; resolving it is a few us a call).
    """
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    labels = check_norm_options(opts)
    stages = pipeline_stages(mesh, opts.pp_dim, opts.pp_mesh)

    names = leaves.names() if (opts.groups or opts.tied) else None
    tensors, shards = list(leaves.tensors), list(leaves.shards)
    # A Partial leaf reduced below keeps its mesh: the world is known before.
    leaf_meshes = [t.device_mesh for t in tensors if isinstance(t, DTensor)] if leaves.has_dtensor else []
    world = known if known is not None else resolve_world(mesh, stages, leaf_meshes)
    if on_world is not None:
        on_world(world)
    if opts.partial == "reduce":
        for i, t in enumerate(tensors):
            if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
                tensors[i] = reduced = _for_leaf(leaves, i, reduce_partial, t)
                shards[i] = reduced.to_local()
    tied_n = tied_stages(names, opts.tied) if names is not None else None
    if not leaf_meshes and tied_n is None:
        # Plain, untied tensors: each is held by every rank of its stage (no per-leaf call on 10^4 leaves).
        weights = [1.0 / world.stage_size] * len(tensors)
    else:
        weights = [
            1.0 / (_for_leaf(leaves, i, count_copies, world, t) * (tied_n[i] if tied_n else 1))
            for i, t in enumerate(tensors)
        ]
    # Leaves in no group form one more group, so the total covers every leaf.
    n = len(labels) + 1
    group_of = list(group_indices(names, opts.groups)) if opts.groups and names is not None else [0] * len(tensors)
    device = shards[0].device if shards else mesh_device(world.mesh)
    if opts.params is not None:
        slots = leaf_slots(opts.params, leaves.index, len(leaves.flat), leaves.paths)
        stats = _with_param_entries(shards, weights, group_of, n, slots, len(opts.params.names), kind, device, opts)
    else:
        stats = local_statistics(shards, weights, group_of, n, kind, device, overflow_safe=opts.overflow_safe)
    return world, stats, labels


def _with_param_entries(
    shards: list[torch.Tensor],
    weights: list[float],
    group_of: list[int],
    n_groups: int,
    slots: list[int],
    n_params: int,
    kind: NormKind,
    device: torch.device,
    opts: NormOptions,
) -> torch.Tensor:
    """This rank's encoded statistics with one more entry per parameter of the whole model.

    Every leaf's statistic is taken once (:func:`leaf_statistics`) and goes
    both to its group's entry and to its parameter's: the groups' entries
    are combined from the per-leaf ones, so no gradient is read twice.
    Entries of parameters held by other stages keep the combine's identity.
    """
    per_leaf = leaf_statistics(shards, kind, overflow_safe=opts.overflow_safe)
    if kind.op == "sum":
        per_leaf = per_leaf * constant(weights, STAT_DTYPE, per_leaf.device)
    # Each leaf's group entry, then its parameter entry.
    index = group_of + [n_groups + s for s in slots]
    entries = torch.full((n_groups + n_params,), kind.identity, dtype=STAT_DTYPE, device=per_leaf.device)
    source = torch.cat([per_leaf, per_leaf])
    on_device = constant(index, torch.int64, per_leaf.device)
    if kind.op == "sum":
        entries = entries.index_add(0, on_device, source)
    else:
        entries = entries.scatter_reduce(0, on_device, source, "amax" if kind.op == "max" else "amin")
    # What this rank holds of each entry: the highest level of its leaves there (static: shapes only).
    levels = [ABSENT] * (n_groups + n_params)
    for i, size in zip(index, [*map(torch.Tensor.numel, shards)] * 2):
        levels[i] = max(levels[i], HAS_ELEMENT if size else HAS_LEAF)
    return kind.encode(entries.to(device), constant(levels, STAT_DTYPE, device))


def _for_leaf(leaves: Leaves, i: int, fn: Any, *args: Any) -> Any:
    """Calls ``fn(*args)`` about leaf ``i``; a ``ValueError`` it raises is re-raised naming the leaf."""
    try:
        return fn(*args)
    except ValueError as e:
        raise ValueError(f"gradient leaf {leaves.paths()[i]} {e}") from None
