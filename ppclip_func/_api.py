"""Public API: measure the global norm, apply a clip, or both, over a device mesh."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ._layout import copies, pipeline_dims, resolve_world
from ._local import local_statistics
from ._norms import NormKind, norm_kind
from ._reduce import all_reduce_statistics
from ._scale import clip_coefficient, scale
from ._tree import Leaves, flatten_grads

__all__ = ["clip_grad_norm", "clip_grad_norm_", "clip_grads_with_norm", "global_grad_norm"]

PyTree = TypeVar("PyTree")
PpDim = str | Sequence[str] | None


@torch.no_grad()
def global_grad_norm(
    grads: Any, mesh: DeviceMesh | None, norm_type: float = 2.0, *, pp_dim: PpDim = None
) -> torch.Tensor:
    """Returns the norm of the whole model's gradient, with one collective.

    Every leaf is weighed by its layout (see the README's "How one collective
    counts every element once"), the weighted local statistics are combined
    on this rank, and a single ``all_reduce`` over the ranks of ``mesh``
    completes the sum (or max/min). Nothing here reads a tensor value on the
    host.

    Args:
        grads: A pytree of ``torch.Tensor``/``DTensor`` gradients; ``None``
            leaves are skipped.
        mesh: The device mesh spanning every rank that holds part of the
            model, e.g. ``("pp", "dp_shard", "tp")``; or ``None`` for a model
            held whole on this rank (DTensor leaves are then still reduced
            over their own mesh, like ``full_tensor()``).
        norm_type: ``p > 0``, ``0`` (number of non-zero elements), ``inf`` or
            ``-inf``.
        pp_dim: Name(s) of the mesh dims whose coordinates hold different
            parts of the model (pipeline stages). Default: ``"pp"`` if the mesh
            has such a dim, else none.

    Returns:
        A 0-dim float32 tensor (float64 if any leaf is float64) on the grads'
        device, bitwise equal on every rank of ``mesh``.

    Raises:
        TypeError: A leaf is not a real floating-point tensor, or
            ``norm_type`` is not a number.
        ValueError: ``norm_type`` is negative and finite, ``pp_dim`` is not a
            dim of ``mesh``, this rank or a leaf's mesh lies outside ``mesh``,
            or a leaf has a ``Partial`` placement.

    Example:
        >>> import torch
        >>> from ppclip_func import global_grad_norm
        >>> grads = {"w": torch.full((3,), 2.0), "b": None, "h": [torch.ones(4, 4)]}
        >>> global_grad_norm(grads, None)
        tensor(5.2915)
    """
    kind = norm_kind(norm_type)
    leaves = flatten_grads(grads)
    return _total_norm(leaves, mesh, kind, pp_dim)


@torch.no_grad()
def clip_grads_with_norm(
    grads: PyTree, max_norm: float | torch.Tensor, total_norm: torch.Tensor, *, eps: float = 1e-6
) -> PyTree:
    """Returns ``grads`` scaled by ``min(max_norm / (total_norm + eps), 1)``.

    Pure: the inputs are not modified. Each DTensor comes back a DTensor with
    the same mesh, placements, shape and stride; dtypes and devices are kept.
    Local shards are scaled directly, so no DTensor dispatch happens per leaf.

    Args:
        grads: A pytree of ``torch.Tensor``/``DTensor`` gradients or ``None``.
        max_norm: The largest norm allowed, a number or a 0-dim tensor.
        total_norm: The norm to clip against, as from :func:`global_grad_norm`.
        eps: Added to ``total_norm`` before dividing.

    Returns:
        The scaled gradients, with the structure of ``grads``.

    Raises:
        TypeError: A leaf is not a real floating-point tensor.
        ValueError: ``max_norm`` or ``eps`` is negative or NaN.

    Example:
        >>> import torch
        >>> from ppclip_func import clip_grads_with_norm
        >>> clip_grads_with_norm([torch.full((4,), 3.0)], 1.0, torch.tensor(6.0), eps=0.0)
        [tensor([0.5000, 0.5000, 0.5000, 0.5000])]
    """
    _check_clip_args(max_norm, eps)
    leaves = flatten_grads(grads)
    coef = clip_coefficient(max_norm, total_norm, eps)
    return leaves.unflatten(_rewrap(leaves, scale(leaves.locals, coef, inplace=False)))


@torch.no_grad()
def clip_grad_norm(
    grads: PyTree,
    mesh: DeviceMesh | None,
    max_norm: float | torch.Tensor,
    norm_type: float = 2.0,
    *,
    pp_dim: PpDim = None,
    eps: float = 1e-6,
) -> tuple[PyTree, torch.Tensor]:
    """Clips a gradient pytree by the global norm over ``mesh``; pure.

    Equivalent to :func:`global_grad_norm` followed by
    :func:`clip_grads_with_norm`, sharing one flattening of the tree. Exactly
    one collective is issued (none when nothing is distributed), and the
    whole function traces into one ``torch.compile`` graph.

    Args:
        grads: A pytree of ``torch.Tensor``/``DTensor`` gradients or ``None``.
        mesh: The world mesh, or ``None`` (see :func:`global_grad_norm`).
        max_norm: The largest norm allowed, a number or a 0-dim tensor.
        norm_type: ``p > 0``, ``0``, ``inf`` or ``-inf``.
        pp_dim: The pipeline dim name(s) of ``mesh`` (default ``"pp"`` if present).
        eps: Added to the total norm before dividing.

    Returns:
        ``(clipped, total_norm)``: the scaled gradients, with the structure
        of ``grads``, and the norm before clipping.

    Raises:
        TypeError, ValueError: As :func:`global_grad_norm` and
            :func:`clip_grads_with_norm`.

    Example:
        >>> import torch
        >>> from ppclip_func import clip_grad_norm
        >>> clipped, norm = clip_grad_norm({"w": torch.full((4,), 3.0), "b": None}, None, max_norm=1.0)
        >>> norm
        tensor(6.)
        >>> clipped["w"], clipped["b"]
        (tensor([0.5000, 0.5000, 0.5000, 0.5000]), None)
    """
    _check_clip_args(max_norm, eps)
    kind = norm_kind(norm_type)
    leaves = flatten_grads(grads)
    total = _total_norm(leaves, mesh, kind, pp_dim)
    coef = clip_coefficient(max_norm, total, eps)
    return leaves.unflatten(_rewrap(leaves, scale(leaves.locals, coef, inplace=False))), total


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor] | Any,
    mesh: DeviceMesh | None,
    max_norm: float | torch.Tensor,
    norm_type: float = 2.0,
    *,
    pp_dim: PpDim = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Clips ``p.grad`` of every parameter in place by the global norm over ``mesh``.

    The drop-in for a torchtitan-style trainer: same norm and the same one
    collective as :func:`clip_grad_norm`, but the gradients are scaled in
    place (one ``_foreach_mul_`` per device and dtype) and only the norm is
    returned. Parameters without a gradient are skipped. A generator is
    consumed once, into a list, so it is never silently exhausted.

    Args:
        parameters: A tensor, an iterable of tensors (a generator works), or
            a pytree of them such as ``dict(model.named_parameters())``.
        mesh: The world mesh, or ``None`` (see :func:`global_grad_norm`).
        max_norm: The largest norm allowed, a number or a 0-dim tensor.
        norm_type: ``p > 0``, ``0``, ``inf`` or ``-inf``.
        pp_dim: The pipeline dim name(s) of ``mesh`` (default ``"pp"`` if present).
        eps: Added to the total norm before dividing.

    Returns:
        The total norm of the gradients before clipping.

    Raises:
        TypeError, ValueError: As :func:`clip_grad_norm`; leaf paths name
            the parameter.

    Example:
        >>> import torch
        >>> from ppclip_func import clip_grad_norm_
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> model.weight.grad = torch.tensor([[3.0, 4.0]])
        >>> clip_grad_norm_(model.parameters(), None, max_norm=1.0)
        tensor(5.)
        >>> model.weight.grad
        tensor([[0.6000, 0.8000]])
    """
    _check_clip_args(max_norm, eps)
    kind = norm_kind(norm_type)
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    elif not isinstance(parameters, (list, tuple, dict)) and isinstance(parameters, Iterable):
        parameters = list(parameters)
    grads = [_grad_of(p) for p in _parameter_leaves(parameters)]
    leaves = flatten_grads(grads, what="parameter grad")
    total = _total_norm(leaves, mesh, kind, pp_dim)
    scale(leaves.locals, clip_coefficient(max_norm, total, eps), inplace=True)
    return total


def _parameter_leaves(parameters: Any) -> list[Any]:
    from torch.utils import _pytree as pytree

    return pytree.tree_leaves(parameters)


def _grad_of(p: Any) -> torch.Tensor | None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"parameters must be tensors, got {type(p).__name__}")
    return p.grad


def _total_norm(leaves: Leaves, mesh: DeviceMesh | None, kind: NormKind, pp_dim: PpDim) -> torch.Tensor:
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    pp = pipeline_dims(mesh, pp_dim)
    leaf_meshes = [t.device_mesh for t in leaves.tensors if isinstance(t, DTensor)]
    world = resolve_world(mesh, pp, leaf_meshes)
    weights = [1.0 / copies(world, t, path) for t, path in zip(leaves.tensors, leaves.paths)]
    device = leaves.locals[0].device if leaves.locals else _mesh_device(world.mesh)
    stats = local_statistics(leaves.locals, weights, [0] * len(weights), 1, kind, device)
    reduced = all_reduce_statistics(stats, kind.op, world.group_name)
    if kind.op == "sum":
        total = kind.root(reduced[0])
    elif kind.op == "max":
        total = reduced[0]
    else:  # -inf: a norm of nothing is 0, as in torch; reduced[1] < 0 iff some rank held an element
        total = torch.where(reduced[1] < 0, reduced[0], torch.zeros_like(reduced[0]))
    out_dtype = torch.float64 if any(t.dtype == torch.float64 for t in leaves.locals) else torch.float32
    return total.to(out_dtype)


def _mesh_device(mesh: DeviceMesh | None) -> torch.device:
    if mesh is None or mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def _rewrap(leaves: Leaves, new_locals: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for leaf, local in zip(leaves.tensors, new_locals):
        if isinstance(leaf, DTensor):
            local = DTensor.from_local(
                local, leaf.device_mesh, leaf.placements, run_check=False, shape=leaf.shape, stride=leaf.stride()
            )
        out.append(local)
    return out


def _check_clip_args(max_norm: float | torch.Tensor, eps: float) -> None:
    if isinstance(max_norm, torch.Tensor):
        if max_norm.dim() != 0:
            raise ValueError(f"max_norm must be a number or a 0-dim tensor, got shape {tuple(max_norm.shape)}")
    elif isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"max_norm must be a number or a 0-dim tensor, got {type(max_norm).__name__}")
    elif math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or math.isnan(eps) or eps < 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
