"""The failure path: a rank that fails still joins the collective, then every rank raises.

A clip's one all-reduce is a meeting every rank of the world must attend.
A rank can fail before it: an option only some ranks pass, a bad leaf on
one pipeline stage, a kernel that rejects a dtype. If it raised at once, its
peers would wait in the all-reduce until the backend's timeout. So every
failure before the collective goes through this module, and nowhere else:

* :func:`checked` runs a public form's own argument checks; a rank they
  fail on first takes part in the ranks-agree check (which raises a
  ``Disagreement`` on every rank if the ranks were given different
  options), then joins the statistics all-reduce with a poison, then raises;
* :func:`release` is that join, for a rank that failed later, while reading
  its leaves (``_core.measure``);
* the poison makes every norm NaN on every rank (``NormKind.poison``), so
  the peers return a NaN norm and their own policy for it (``nonfinite``)
  decides what happens next, the same on every rank.

Under ``torch.compile`` the join runs at trace time: a rank whose input
fails validation fails while tracing, so it cannot wait for a graph, while
its peers, running their compiled graph, are already in the all-reduce.
The tests of this path: tests/test_robustness_distributed.py,
tests/test_reliability_ranks.py and tests/test_agree_ranks.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from .agreement import carries_state, check_options, state_poison
from .collective import all_reduce_statistics, leaf_meshes, mesh_device, world_of
from .norms import NormKind, norm_kind
from .setup import NormOptions, n_entries, norm_p, static_options

__all__: list[str] = []

T = TypeVar("T")


def checked(
    validate: Callable[[], T],
    mesh: Any,
    given: Any,
    norm_type: Any,
    opts: NormOptions,
    state: tuple[torch.Tensor, ...] | None = None,
) -> T:
    """Returns ``validate()``, a public form's own argument checks, run so that a rank they fail on
    leaves no peer waiting.

    An argument can be valid on some ranks and not on others (an
    ``exclude=`` label only some ranks' ``groups`` define): a rank that
    raises here first takes part in the ranks-agree check and, if that
    passes, joins the statistics all-reduce with a poison.
    """
    try:
        return validate()
    except Exception:
        try:
            kind: NormKind | None = norm_kind(norm_type)
        except (TypeError, ValueError):
            kind = None  # every rank that passed this norm_type is here too: no all-reduce to join
        release(mesh, given, kind, opts, state, static_options(norm_p(norm_type), opts, state))
        raise


def release(
    mesh: Any, given: Any, kind: NormKind | None, opts: NormOptions, state: Any, options: dict[str, Any] | None
) -> None:
    """Joins the collective for a rank that failed; with ``options``, it takes part in their check first."""
    release_peers(
        mesh,
        given,
        kind,
        opts.pp_dim,
        opts.pp_mesh,
        n_entries(opts),
        n_sums=opts.sums,
        with_state=state is not None,
        options=None if options is None else (options, opts.tied),
    )


def release_peers(
    mesh: DeviceMesh | None,
    grads: Any,
    kind: NormKind | None,
    pp_dim: Any,
    pp_mesh: Any,
    n_groups: int,
    n_sums: int = 0,
    with_state: bool = False,
    options: tuple[Mapping[str, Any], Any] | None = None,
) -> None:
    """Joins the statistics all-reduce with a poison that makes every group's norm NaN on every rank.

    Called by a rank that failed before its collective, whatever the error,
    so that its peers, which cannot know, never wait for it. Does nothing
    when there is no collective to join: no mesh and no DTensor leaf, or the
    world itself cannot be resolved (then every rank of that world fails
    alike, before any collective).

    Under ``torch.compile`` the join runs for real, at trace time: a rank
    whose input fails validation fails while tracing, so the join cannot
    wait for a graph, while its peers, running their compiled graph, are
    already in the all-reduce.

    Args:
        mesh: The caller's world mesh argument, or ``None``.
        grads: What the caller was given (gradients or parameters); with
            ``mesh=None`` its DTensor leaves name the world, as in the clip.
        kind: The norm being computed (``None``: not a valid norm type, so no
            rank of this configuration reaches the all-reduce).
        pp_dim: The caller's ``pp_dim`` argument.
        pp_mesh: The caller's ``pp_mesh`` argument.
        n_groups: Number of groups, including the one for leaves in no group.
        n_sums: Number of the step's other summed statistics after the
            norms' (``NormOptions.sums``): joined with NaN, as the norms.
        with_state: The call carries an adaptive state's fingerprint
            (``_core.agreement``): its entries are joined with NaN, which lets them pass.
        options: ``(options, tied)`` when this rank failed before its options
            check (``_core.agreement.check_options``): it takes part in that check
            first, as its peers do (and raises its ``Disagreement`` if any).
    """
    meshes = leaf_meshes(mesh, grads)
    if options is not None and (world := world_of(mesh, meshes, pp_dim, pp_mesh)) is not None:
        check_options(world, *options)
    if kind is None:
        return  # a norm_type no rank could use: every rank fails alike, before any all-reduce
    if torch.compiler.is_compiling():
        _join_at_trace_time(mesh, tuple(meshes), kind.p, pp_dim, pp_mesh, n_groups, n_sums, with_state)
    else:
        _join(mesh, meshes, kind, pp_dim, pp_mesh, n_groups, n_sums, with_state)


@torch.compiler.assume_constant_result
def _join_at_trace_time(
    mesh: Any, leaf_meshes: Any, p: float, pp_dim: Any, pp_mesh: Any, n_groups: int, n_sums: int, with_state: bool
) -> bool:
    # Dynamo calls this with the real arguments (plain values: it does not pass
    # a NormKind through intact) and runs it eagerly; tensors made while
    # tracing are fake, so the poison is made outside the fake mode.
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        _join(mesh, list(leaf_meshes), norm_kind(p), pp_dim, pp_mesh, n_groups, n_sums, with_state)
    return True


def _join(
    mesh: Any,
    leaf_meshes: list,
    kind: NormKind,
    pp_dim: Any,
    pp_mesh: Any,
    n_groups: int,
    n_sums: int,
    with_state: bool,
) -> None:
    world = world_of(mesh, leaf_meshes, pp_dim, pp_mesh)
    if world is None or world.group_name is None:
        return
    stats = kind.poison(n_groups, mesh_device(world.mesh))
    if n_sums:
        stats = torch.cat([stats, stats.new_full((n_sums,), torch.nan)])
    if with_state and carries_state(world):
        stats = torch.cat([stats, state_poison(stats.device)])
    funcol.wait_tensor(all_reduce_statistics(stats, kind, world))
