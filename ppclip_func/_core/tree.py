"""Gradient pytrees: flattening with paths, local shards, and input validation.

Validation looks only at static facts (types, dtypes, devices, placements),
which every rank of an SPMD program sees alike, and it runs before the
collective: a bad call raises on every rank instead of leaving some ranks
waiting in an all-reduce that others skipped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

__all__: list[str] = []

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
# Leaf types that need no per-leaf check beyond their dtype (parameters' grads are plain tensors).
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


@dataclasses.dataclass
class Leaves:
    """The tensor leaves of a gradient pytree, in flattening order.

    Attributes:
        tree: The pytree itself.
        flat: Every leaf of the tree (``None`` included), for unflattening.
        spec: The tree structure (``None`` until :meth:`unflatten` needs it,
            for a flat list or tuple).
        index: Position in ``flat`` of each tensor leaf.
        tensors: The tensor leaves (``torch.Tensor`` or ``DTensor``).
        shards: The local shard of each leaf (the leaf itself for plain tensors).
        has_dtensor: Whether any leaf is a ``DTensor``.
    """

    tree: Any
    flat: list[Any]
    spec: pytree.TreeSpec | None
    index: list[int]
    tensors: list[torch.Tensor]
    shards: list[torch.Tensor]
    has_dtensor: bool = False

    def paths(self) -> list[str]:
        """Returns the pytree path of each tensor leaf, as ``keystr`` prints it.

        Computed on demand (for ``groups``/``tied`` and error messages): key
        paths cost more than the flattening itself on a tree of many leaves.
        """
        every = _paths(self.tree)
        return [every[i] for i in self.index]

    def names(self) -> list[str]:
        """Returns the dotted name of each tensor leaf: its keys joined by ``.``.

        For ``dict(model.named_parameters())`` that is the parameter name
        (``layers.0.attn.wq.weight``); for a list, the index (``3``); for
        nested containers, the keys on the way (``blocks.0.w``). ``groups``
        and ``tied`` patterns match these.
        """
        every = self.all_names()
        return [every[i] for i in self.index]

    def all_names(self) -> list[str]:
        """Returns the dotted name of every leaf of ``flat``, ``None`` leaves included."""
        if self.spec is None:  # a flat list, tuple or dict (flatten_grads' fast path): its keys or indices
            return [str(k) for k in self.tree] if type(self.tree) is dict else [str(i) for i in range(len(self.flat))]
        return [".".join(_key_name(k) for k in path) for path, _ in pytree.tree_flatten_with_path(self.tree)[0]]

    def unflatten(self, new_tensors: list[torch.Tensor]) -> Any:
        """Returns the tree with each tensor leaf replaced by ``new_tensors[i]``."""
        flat = list(self.flat)
        for i, t in zip(self.index, new_tensors):
            flat[i] = t
        if self.spec is None:
            self.spec = pytree.tree_structure(self.tree)
        return pytree.tree_unflatten(flat, self.spec)


def flatten_grads(grads: Any, what: str = "gradient") -> Leaves:
    """Flattens ``grads`` and checks each leaf.

    Raises:
        TypeError: A leaf is neither a tensor nor ``None``, or its dtype is
            not float16, bfloat16, float32 or float64.
        ValueError: Leaves sit on different devices.
    """
    if type(grads) in (list, tuple, dict):
        # A flat list (or dict, e.g. of named parameters' grads) is its own
        # flattening, in the order tree_flatten gives: no per-leaf pytree work,
        # and the spec is built only if unflatten needs it. _check_leaves falls
        # back to tree_flatten if it holds containers.
        return _check_leaves(grads, what, list(grads.values() if type(grads) is dict else grads), None)
    return _check_leaves(grads, what, *pytree.tree_flatten(grads))


def _check_leaves(grads: Any, what: str, flat: list[Any], spec: pytree.TreeSpec | None) -> Leaves:
    kinds = set(map(type, flat))
    if kinds <= _PLAIN and {t.dtype for t in flat} <= _SUPPORTED:
        # The common case, checked by set operations: plain tensors of supported dtypes, no None.
        return _on_one_device(Leaves(grads, flat, spec, list(range(len(flat))), flat, flat), what)
    index, tensors, has_dtensor = [], [], False
    for i, leaf in enumerate(flat):
        if leaf is None:
            continue
        if isinstance(leaf, DTensor):
            has_dtensor = True
        elif not isinstance(leaf, torch.Tensor):
            if spec is None:
                return _check_leaves(grads, what, *pytree.tree_flatten(grads))
            name = _paths(grads)[i]
            raise TypeError(f"{what} leaf {name} must be a torch.Tensor, a DTensor or None, got {type(leaf).__name__}")
        if leaf.dtype not in SUPPORTED_DTYPES:
            name = _paths(grads)[i]
            raise TypeError(
                f"{what} leaf {name} has dtype {leaf.dtype}; only float16, bfloat16, float32 and float64 "
                "gradients have a norm here (float8 grads have no norm or foreach kernels: upcast them first)"
            )
        index.append(i)
        tensors.append(leaf)
    locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in tensors] if has_dtensor else tensors
    return _on_one_device(Leaves(grads, flat, spec, index, tensors, locals_, has_dtensor), what)


def _on_one_device(leaves: Leaves, what: str) -> Leaves:
    """Returns ``leaves`` if all its shards share one device; raises naming two that do not."""
    shards = leaves.shards
    if len({t.device for t in shards}) > 1:
        first = shards[0].device
        j = next(j for j, t in enumerate(shards) if t.device != first)
        paths = leaves.paths()
        raise ValueError(
            f"{what} leaves {paths[0]} and {paths[j]} are on different devices "
            f"({first} and {shards[j].device}); a clip works on one device per rank"
        )
    return leaves


def _paths(tree: Any) -> list[str]:
    """Returns the ``keystr`` path of every leaf of ``tree`` (``<root>`` for a bare leaf)."""
    return [pytree.keystr(path) or "<root>" for path, _ in pytree.tree_flatten_with_path(tree)[0]]


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):  # MappingKey, SequenceKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)
