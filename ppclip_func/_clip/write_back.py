"""Writing new values into the tensors that live from one step to the next, in place, compiled or not.

A step captured in a CUDA graph, or compiled with its state kept in
persistent tensors, ends by writing the new state (parameters, optimizer
moments and step counts, the clip's statistics) into those tensors. Written
as ``torch._foreach_copy_(state, new)`` or ``t.copy_(new)`` inside a
``torch.compile``d function, that write is turned by functionalization into
a copy into a graph input, and inductor may compute the new value directly
into the input's memory. Measured on torch 2.11.0 to 2.14.1 (CPU inductor):
when the same kernel also reads the *old* value later on, it is handed the
new one (``new_var = f(var, mean)`` read the already-updated ``mean``), and
on 2.11 to 2.13 a second, separate ``copy_`` into a graph input can vanish
from the graph. The step then trains on wrong statistics, silently, unless
it also returns the new values (outputs get buffers of their own).

Here every such write is one ``torch.library`` op,
``ppclip_func::write_back_``, that declares the tensors it mutates. Traced,
functionalization and inductor see an opaque call with a declared mutation:
the new values are computed into buffers of their own by kernels that run
before it (every read of the old values included), and the op then copies
them, with one ``_foreach_copy_`` (one multi-tensor launch per device and
dtype on a GPU). It is right whatever the step returns, on every release
tested, and eager it is the same ``_foreach_copy_``. Where the persistent
tensors were not written earlier in the step (the functional recipe, the
adaptive state), inductor hands the op the persistent tensors themselves:
the new values are computed into buffers and copied once.

Three in-place writes are left as they are, each for a reason:

* the in-place clips' scaling of ``.grad`` (one ``_foreach_mul_``), which
  inductor fuses with the optimizer's read of the gradients: no kernel of
  the step needs the unscaled gradients after it;
* :func:`~ppclip_func.skip_update_`'s undo, one ``_foreach_copy_`` of
  ``where(skip, saved, updated)`` that inductor fuses with the update: the
  update has already written those tensors, so through the op inductor
  would copy them out and back around it (bench/write_back_study.py);
* the optimizer hand-over's ``grad_scale`` and ``found_inf``, written by a
  function that is never traced (``torch.compiler.disable``).

``tests/test_write_back.py`` checks the compiled steps that use each of
them, returning nothing, against the same steps run eagerly, on every
torch release tested.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from .._base.ops import implements

__all__ = ["write_back_"]


@implements("write_back_")
def _write_back(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i] = src[i]`` for every ``i``, as if every source were read before any destination is written."""
    # A source that shares memory with a destination other than its own (a swap, a view of another
    # piece of state) would be read after that destination is written: those are copied first.
    written = {t.untyped_storage().data_ptr() for t in dst}
    src = [s.clone() if s is not d and s.untyped_storage().data_ptr() in written else s for d, s in zip(dst, src)]
    torch._foreach_copy_(dst, src)


_write_back_op = torch.ops.ppclip_func.write_back_.default


def copy_into_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Writes ``src[i]`` into ``dst[i]`` in place with the one op; the caller has checked the pairs match.

    Plain tensors only (DTensors as their local shards); shapes, dtypes and
    devices equal. Runs under ``torch.no_grad()``, as an optimizer writes
    its parameters.
    """
    pairs = [(d, s) for d, s in zip(dst, src) if d is not s]
    if not pairs:
        return
    # Eager ops run in program order: the op (a Python dispatch of some microseconds) is for tracing.
    write = _write_back_op if torch.compiler.is_compiling() else _write_back
    with torch.no_grad():
        write([d for d, _ in pairs], [s.detach() for _, s in pairs])


def write_back_(persistent: Any, new: Any) -> None:
    """Writes every tensor of ``new`` into the tensor at the same place in ``persistent``, in place.

    The one call that ends a functional step whose state must stay where it
    is: the parameters, the optimizer's moments and step counts and the
    clip's :class:`~ppclip_func.ClipState` (or anything else) in tensors
    marked static for a CUDA graph, or simply kept across calls of a
    ``torch.compile``d step. ``persistent`` keeps its storage; nothing is
    read on the host.

    Inside a compiled step this is right whatever the step returns, unlike
    a hand-written ``torch._foreach_copy_(persistent, new)``, which torch's
    inductor can reorder (2.11 to 2.14: a new value computed into a state
    tensor before an old value that is still needed has been read, when the
    step does not also return the new values; on 2.11 to 2.13 a separate
    ``copy_`` can be dropped). The write is one ``torch.library`` op that
    declares what it mutates, so every kernel that reads the old values
    runs before it. Eager, it is one ``torch._foreach_copy_``.

    Args:
        persistent: A pytree of tensors (parameters, optimizer state, a
            :class:`~ppclip_func.ClipState`, ...): written in place.
            DTensors are written through their local shards.
        new: A pytree of the same structure, with tensors of the same
            shapes, dtypes and devices (DTensors of the same mesh and
            placements). A leaf that *is* the persistent tensor is left
            alone. ``None`` leaves must be ``None`` in both.

    Raises:
        ValueError: The two trees differ in structure, or a pair of leaves
            in shape, device, mesh or placements (the leaf's path named).
        TypeError: A leaf of ``persistent`` is not a tensor, or a pair
            differs in dtype or in being a DTensor (the path named).

    Example:
        >>> import torch
        >>> from ppclip_func import write_back_
        >>> state = {"w": torch.zeros(2), "step": torch.tensor(0.0)}
        >>> kept = state["w"]
        >>> write_back_(state, {"w": torch.tensor([1.0, 2.0]), "step": state["step"] + 1})
        >>> state["w"] is kept, state
        (True, {'w': tensor([1., 2.]), 'step': tensor(1.)})
    """
    dst_flat, dst_spec = pytree.tree_flatten(persistent)
    src_flat, src_spec = pytree.tree_flatten(new)
    if dst_spec != src_spec:
        raise ValueError(
            f"new must have the structure of persistent: {_describe(src_spec)} given for {_describe(dst_spec)}"
        )
    dst, src = [], []
    for i, (d, s) in enumerate(zip(dst_flat, src_flat)):
        if d is None and s is None:
            continue
        if isinstance(d, DTensor) and isinstance(s, DTensor) and _same_layout(d, s):
            d, s = d.to_local(), s.to_local()
        problem = _mismatch(d, s)
        if problem is not None:
            error, message = problem
            where = pytree.keystr(pytree.tree_flatten_with_path(persistent)[0][i][0]) or " (the tree itself)"
            raise error(message.format(d=f"persistent{where}", s=f"new{where}"))
        dst.append(d)
        src.append(s)
    copy_into_(dst, src)


def _same_layout(d: DTensor, s: DTensor) -> bool:
    return d.device_mesh == s.device_mesh and d.placements == s.placements


def _mismatch(d: Any, s: Any) -> tuple[type[Exception], str] | None:
    """Why ``s`` cannot be written into ``d`` (the error and its message, ``{d}``/``{s}`` the leaves' paths).

    DTensors of one layout arrive as their local shards: a DTensor still here is a mismatch.
    """
    if not isinstance(d, torch.Tensor):
        return TypeError, f"{{d}} must be a tensor to be written in place, got {type(d).__name__}"
    if not isinstance(s, torch.Tensor):
        return TypeError, f"{{s}} must be a tensor, got {type(s).__name__}"
    if isinstance(d, DTensor) != isinstance(s, DTensor):
        return TypeError, "{d} and {s} must both be DTensors or neither"
    if isinstance(d, DTensor) and isinstance(s, DTensor):  # both, by the check above
        return ValueError, (
            f"{{s}} is laid out as {s.placements} on {s.device_mesh}, {{d}} as {d.placements} on "
            f"{d.device_mesh}: their local shards do not correspond"
        )
    if d.dtype != s.dtype:
        return TypeError, f"{{s}} is {s.dtype}, {{d}} is {d.dtype}: write a value of the persistent tensor's dtype"
    if d.shape != s.shape or d.device != s.device:
        return ValueError, (
            f"{{s}} is {tuple(s.shape)} on {s.device}, {{d}} is {tuple(d.shape)} on {d.device}: "
            "write a value of the persistent tensor's shape and device"
        )
    return None


def _describe(spec: pytree.TreeSpec) -> str:
    text = str(spec)
    return text if len(text) <= 200 else text[:197] + "..."
