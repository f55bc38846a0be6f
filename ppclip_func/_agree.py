"""Ranks that disagree on a static option: one clear error on every rank, never a wrong norm or a hang.

Every option that shapes or interprets the reduced vector (the group labels and
patterns, ``exclude``, ``tied``, ``norm_type``, ``partial``, ``overflow_safe``,
the ``param_norms`` index, the pipeline dims) must be the same on every rank of
the world. The first time a configuration is seen on a world group, each rank
hashes each option to one int64 and all-gathers that fixed-size vector (one
small extra collective, never again for that configuration: cached, as the
pipeline-stage table is). Fixed size: ranks whose options differ, even in the
number of groups, still join the same gather, so the check itself cannot hang.
Every rank then sees the same table and raises the same :class:`Disagreement`,
naming each option and the ranks that differ from rank 0, before the statistics
collective and before any gradient is scaled. Under ``torch.compile`` the check
runs at trace time (:func:`torch.compiler.assume_constant_result`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

__all__: list[str] = []

FIX = (
    "every rank must pass the same static options; for groups=, build the mapping from the whole model's "
    "parameter names on every rank (e.g. groups={n: n for n in full_model_names}), not from this "
    "pipeline stage's own named_parameters()"
)

_SEEN: set[tuple[Any, ...]] = set()


class Disagreement(ValueError):
    """Ranks passed different static options; raised alike on every rank, before any collective of the clip."""


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def check_agree(group_name: str | None, fields: dict[str, Any]) -> None:
    """Raises :class:`Disagreement` on every rank of ``group_name`` if any rank's ``fields`` differ; once per config.

    ``fields`` maps each option's name to its value (plain Python: its
    ``repr`` is hashed, on the host, at trace time under ``torch.compile``).
    """
    if group_name is None:
        return
    if torch.compiler.is_compiling():
        _check_at_trace_time(group_name, tuple(fields), tuple(fields.values()))
    elif problem := _check(group_name, tuple(fields), tuple(fields.values())):
        raise Disagreement(problem)


@torch.compiler.assume_constant_result
def _check_at_trace_time(group_name: str, names: tuple, values: tuple) -> bool:
    # Dynamo runs this eagerly with the real arguments; the gather is made outside the fake mode.
    # Raised here, torch.compile(fullgraph=True) raises it as the cause of its InternalTorchDynamoError
    # (raised in the traced code, it would be an "Observed exception" Unsupported).
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        problem = _check(group_name, names, values)
    if problem:
        raise Disagreement(problem)
    return True


def _check(group_name: str, names: tuple[str, ...], values: tuple) -> str:
    """Returns ``""`` if every rank's ``values`` hash alike (remembered), else the error's text (same on every rank)."""
    hashes = tuple(_hash(repr(v)) for v in values)
    world = dist.group.WORLD if dist.is_initialized() else None
    key = (id(world), group_name, names, hashes)
    if key in _SEEN:
        return ""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    size = dist.get_world_size(group)
    mine = torch.tensor(hashes, dtype=torch.int64)
    backend = str(dist.get_backend(group))
    device = torch.device("cpu")
    if "nccl" in backend and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    mine = mine.to(device)
    # Filled with this rank's own hashes first: a backend that moves no data (the fake one) agrees.
    table = mine.repeat(size)
    dist.all_gather_into_tensor(table, mine, group=group)
    table = table.view(size, -1).cpu()
    differ = (table != table[0]).any(dim=0)
    if bool(differ.any()):
        ranks = dist.get_process_group_ranks(group)
        parts = []
        for j in differ.nonzero().flatten().tolist():
            odd = [ranks[r] for r in (table[:, j] != table[0, j]).nonzero().flatten().tolist()]
            parts.append(f"{names[j]} (ranks {odd} differ from rank {ranks[0]})")
        return f"ranks disagree on {', '.join(parts)}: {FIX}"
    _SEEN.add(key)
    return ""
