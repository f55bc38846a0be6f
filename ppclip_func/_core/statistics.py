"""Local statistics: one rank's weighted contribution to each norm, before any collective.

Every local shard is read once and accumulated in float32 at least (float64
for float64 grads, or for all grads with ``overflow_safe``), so bf16/fp16
gradients keep fp32 precision. Leaves are bucketed by (group, weight), and
each bucket yields one float64 statistic (``sum |x|^p``, a count, a max or a
min).

Accuracy comes from short accumulations. torch's CPU norm kernels add a
whole tensor into one accumulator (16 vector lanes for an fp32 2-norm, one
scalar for the other orders and for a bf16 input with an fp32 result), whose
error grows with the leaf and is biased for bf16-valued data. So 2-norms
are taken over rows of ``ROW`` elements (fp32 leaves up to ``WHOLE``
whole), other orders as a cascade ``sum`` of ``|x|^p``, and the partial
results are combined in float64. No path reduces a leaf with a BLAS call,
whose summation order is the vendor's, the CPU's and the thread count's;
threads split rows, never lengthen one, so the bound is the same with any
thread count. The errors behind each choice, and the timings behind the
paths below: bench/README.md, "Why the local statistics are built as they are".

Eager on CPU, per bucket (a parallel region per op costs little on an idle
machine and waits for a core on a busy one, so reads run on the calling
thread alone, as torch's own norms do at every size: packed blocks of small
leaves and row norms of large ones; only the bf16/fp16 conversions, which
are compute-bound, use torch's other threads):

* fp32 (and fp64) 2-norms: leaves up to ``WHOLE`` elements read in place
  by one ``_foreach_norm`` call, as torch's own clip; below ``ROWS_FROM``
  packed side by side into the scratch buffer (one ``cat`` per block) and
  reduced in rows of ``ROW``: a norm op per leaf costs more than the copy
  there; larger ones one row-wise ``vector_norm`` each, in place, their last
  partial row packed with the medium leaves;
* ``±inf``: whole leaves in one ``_foreach_norm`` in their own dtype (exact in
  any order), ``aminmax`` for leaves over ``BLOCK``; ``0``: counts, exact in
  fp32 below 2^24 per leaf, ``count_nonzero`` above;
* everything else (bf16/fp16 leaves, strided leaves, ``p != 2``): streamed
  through a reused scratch buffer of ``BLOCK`` elements in the accumulation
  dtype, filled by conversion copies (small leaves packed by one ``cat`` in
  their own dtype, then converted by one copy per block; strided leaves cut
  along their outer dims, never copied whole), then
  reduced block by block. torch's CPU norm of a bf16 input with an fp32
  result is scalar code, several times slower than a bf16->fp32 copy plus an
  fp32 norm of a block still in cache. The buffer is per thread and dtype
  (2 MiB in fp32), so concurrent clips never share one and memory stays
  bounded.

Under ``torch.compile`` on CPU, each bucket is one custom op
(``ppclip_func::cpu_statistic``) that runs this same eager code at step
time (the row norms of large leaves on every thread there, as inductor's
kernels run), so inductor compiles no reduction per leaf, except for dense fp32
leaves of ``ROWS_FROM`` to ``TRACED_ROWS`` elements (the FSDP-shard band) and
dense bf16/fp16 leaves above ``ROWS_FROM``, which :func:`_traced` reduces as
rows inside the graph. On a device whose
``_foreach_norm`` kernel sums each tensor in blocks of partial sums
(``BLOCKWISE_FOREACH``: CUDA), every leaf goes whole into one
``_foreach_norm`` call per dtype, eager or compiled: a clip dispatches a
handful of ops per dtype group, not a few per leaf, so the host does not
set its time at thousands of leaves. On any other device, eager or
compiled, :func:`_traced` views each leaf as rows: shape-static, no scratch
buffer, no loop over blocks.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections import defaultdict
from collections.abc import Iterator

import torch

from .._base.caches import per_process
from .._base.devices import constant
from .._base.ops import implements
from .norms import ABSENT, HAS_ELEMENT, HAS_LEAF, NormKind

__all__: list[str] = []

STAT_DTYPE = torch.float64
# Elements per row of a row-wise 2-norm: 128 per vector lane of torch's kernel; longer rows make the
# bias of its rounding for bf16 data grow.
ROW = 1 << 11
# Elements per scratch block: 2 MiB in fp32, so that a copied block is reduced while still in a core's L2.
BLOCK = 1 << 19
# fp32 dense leaves up to this size have their 2-norm taken whole, by torch's 16-lane kernel: short
# enough to stay within our bound even for bf16-valued data.
WHOLE = 1 << 12
# Larger dense fp32 leaves below this size, eager on CPU: packed into the scratch buffer by one cat
# per block and reduced in rows, since a norm op per leaf costs more than the copy there. From this size
# each gets one row-wise norm, in place (rows that tile the leaf, see _row_width); 2^15 is an FSDP shard
# of a 2048 x 2048 weight over 128 ranks (bench/README.md, "The medium-leaf path"). Compiled, leaves
# above it are the band inductor reduces.
ROWS_FROM = 1 << 15
# Device types whose _foreach_norm reduces each tensor in per-block partial sums, combined by a
# tree (CUDA's multi-tensor norm kernel: blocks of 65536 elements, a few dozen per thread), so a whole
# leaf of any size is accurate to float32 rounding. Tests add "cpu" to run this branch on a CPU.
BLOCKWISE_FOREACH = frozenset({"cuda"})
# Compiled on CPU, dense fp32 leaves of ROWS_FROM to this size (bf16/fp16 ones of any size above ROWS_FROM) are
# reduced by inductor's own row reductions (see _compiled_cpu_statistic); every other leaf by the eager
# code, as one op.
TRACED_ROWS = 1 << 18
# Leaves up to this size (contiguous ones; any up to ROW) are packed into the scratch by one cat.
CAT_LIMIT = 1 << 15
# Norm-0 counts are exact in fp32 up to 2^24.
COUNT_WHOLE = 1 << 23

_SCRATCH = threading.local()


def local_statistics(
    tensors: list[torch.Tensor],
    weights: list[float],
    groups: list[int],
    n_groups: int,
    kind: NormKind,
    device: torch.device,
    *,
    overflow_safe: bool = False,
) -> torch.Tensor:
    """Returns this rank's contribution to every group's norm, ready to all-reduce.

    Args:
        tensors: Local shards, one per gradient leaf.
        weights: ``1 / copies`` of each leaf (used by sum-type norms only).
        groups: The group index of each leaf, in ``range(n_groups)``.
        n_groups: Number of groups.
        kind: The norm being computed.
        device: Where the statistics live (the grads' device).
        overflow_safe: Accumulate every leaf in float64: an fp32 leaf whose
            sum of squares passes 3.4e38 (elements around 1e19 and up) then
            still has a finite norm. Off by default because torch's eager
            float64 accumulation is slower than float32 on CPU.

    Returns:
        A float64 vector of ``2 * n_groups`` values, as :meth:`NormKind.encode`
        lays them out: each group's statistic, then what this rank holds of it.
    """
    # Leaves of one (group, weight) are summed (maxed) together: one statistic per bucket.
    buckets: dict[tuple[int, float], list[torch.Tensor]] = defaultdict(list)
    if len(set(groups)) == 1 and (kind.op != "sum" or len(set(weights)) == 1):  # one bucket: no per-leaf keys
        live = tensors if all(map(torch.Tensor.numel, tensors)) else [t for t in tensors if t.numel() > 0]
        if live:
            buckets[(groups[0], weights[0] if kind.op == "sum" else 1.0)] = live
    else:
        for t, w, g in zip(tensors, weights, groups):
            if t.numel() > 0:
                buckets[(g, w if kind.op == "sum" else 1.0)].append(t)
    per_group: dict[int, list[torch.Tensor]] = defaultdict(list)
    for (g, weight), members in buckets.items():
        stat = bucket_statistic(members, kind, overflow_safe=overflow_safe)
        per_group[g].append(stat * weight if kind.op == "sum" and weight != 1.0 else stat)
    combined = {g: parts[0] if len(parts) == 1 else kind.combine(torch.stack(parts)) for g, parts in per_group.items()}
    if len(combined) == n_groups:  # every group has data: no fill, no per-entry writes
        stats = combined[0].reshape(1) if n_groups == 1 else torch.stack([combined[g] for g in range(n_groups)])
    else:
        stats = torch.full((n_groups,), kind.identity, dtype=STAT_DTYPE, device=device)
        for g, stat in combined.items():
            stats[g] = stat
    levels = _levels(tensors, groups, n_groups)
    if n_groups == 1 and kind.op == "sum":  # the common case: the level appended by one op, no host tensor
        return torch.constant_pad_nd(stats, (0, 1), levels[0])
    return kind.encode(stats, constant(levels, STAT_DTYPE, device))


def _levels(tensors: list[torch.Tensor], groups: list[int], n_groups: int) -> list[float]:
    """What this rank holds of each group (static: shapes only), as :class:`NormKind` encodes it."""
    if n_groups == 1:
        if not tensors:
            return [ABSENT]
        return [HAS_ELEMENT if any(t.numel() for t in tensors) else HAS_LEAF]
    levels = [ABSENT] * n_groups
    for t, g in zip(tensors, groups):
        levels[g] = max(levels[g], HAS_ELEMENT if t.numel() > 0 else HAS_LEAF)
    return levels


def leaf_statistics(tensors: list[torch.Tensor], kind: NormKind, *, overflow_safe: bool = False) -> torch.Tensor:
    """Returns one float64 statistic per leaf (``kind.identity`` for an empty one), unweighted.

    The per-parameter norms' counterpart of the bucketed path: each leaf keeps
    its own statistic, with the same precision. Leaves that torch's foreach
    kernel reduces accurately (see :func:`_traced`: small ones, ``±inf`` up
    to ``BLOCK`` elements, counts) share one ``_foreach_norm`` call per dtype;
    every other leaf is one :func:`bucket_statistic` of its own.
    """
    n = len(tensors)
    batched: dict[torch.dtype, list[int]] = defaultdict(list)
    alone: list[int] = []
    empty: list[int] = []
    # A rank's leaves are on one device (flatten_grads checks).
    limits = {d: _foreach_limit(d, kind, overflow_safe, tensors[0].device) for d in {t.dtype for t in tensors}}
    for i, (t, size) in enumerate(zip(tensors, map(torch.Tensor.numel, tensors))):
        if size == 0:
            empty.append(i)
        elif size <= limits[t.dtype]:
            batched[t.dtype].append(i)
        else:
            alone.append(i)
    order: list[int] = []
    parts: list[torch.Tensor] = []
    for dtype, idx in batched.items():
        parts.append(kind.power(_foreach_norms([tensors[i] for i in idx], dtype, kind, overflow_safe).to(STAT_DTYPE)))
        order.extend(idx)
    if alone:
        parts.append(torch.stack([bucket_statistic([tensors[i]], kind, overflow_safe=overflow_safe) for i in alone]))
        order.extend(alone)
    if empty:
        parts.append(torch.full((len(empty),), kind.identity, dtype=STAT_DTYPE, device=tensors[empty[0]].device))
        order.extend(empty)
    if not parts:
        return torch.zeros(0, dtype=STAT_DTYPE)
    stats = parts[0] if len(parts) == 1 else torch.cat(parts)
    if order == list(range(n)):
        return stats
    # Back to leaf order: position order[k] holds stats[k].
    inverse = [0] * n
    for k, i in enumerate(order):
        inverse[i] = k
    return stats[constant(inverse, torch.int64, stats.device)]


def _foreach_limit(dtype: torch.dtype, kind: NormKind, overflow_safe: bool, device: torch.device) -> float:
    """The largest leaf whose statistic one ``_foreach_norm`` call gives within our precision.

    Shared by :func:`leaf_statistics` and :func:`_traced`. (The eager bucketed
    path has its own limits: those are about speed on CPU, not precision.)
    """
    if kind.op != "sum" or device.type in BLOCKWISE_FOREACH:
        return math.inf  # max and min are exact in any order and at any size
    if kind.p == 0.0:
        return COUNT_WHOLE
    if kind.p == 2.0:
        return WHOLE if dtype == _acc_dtype(dtype, overflow_safe) else ROW
    return 0


def bucket_statistic(tensors: list[torch.Tensor], kind: NormKind, *, overflow_safe: bool = False) -> torch.Tensor:
    """Returns the 0-dim float64 statistic of all elements of ``tensors`` together (none empty).

    ``sum |x|^p`` for ``p > 0``, the non-zero count for ``0``, ``max |x|`` or
    ``min |x|`` for ``±inf``.
    """
    device = tensors[0].device.type
    if device == "cpu" and device not in BLOCKWISE_FOREACH:
        if torch.compiler.is_compiling():
            return _compiled_cpu_statistic(tensors, kind, overflow_safe)
        norms, stats = _EagerCpu(kind, overflow_safe).run(tensors)
    else:
        norms, stats = _traced(tensors, kind, overflow_safe)
    return _combine(norms, stats, kind)


def _compiled_cpu_statistic(tensors: list[torch.Tensor], kind: NormKind, overflow_safe: bool) -> torch.Tensor:
    """A CPU bucket in a compiled graph: the eager code as one op, the FSDP-shard band as inductor's rows.

    Dense leaves in their own accumulation dtype of ``ROWS_FROM`` to ``TRACED_ROWS``
    elements, and dense bf16/fp16 leaves of more than ``ROWS_FROM``, take
    :func:`_traced`'s row-wise reduction, which inductor compiles into the
    step: eager code would pay a dispatched op per fp32 leaf there, about as
    long as reading such a leaf, and converts a bf16 leaf through the
    scratch buffer where inductor converts in registers. Every other leaf
    goes to the one op (:func:`_cpu_statistic`): a reduction per leaf costs
    inductor compile time, and for small leaves (packed) and large fp32 ones
    (their op is short beside the read) the eager code is as fast.
    """
    rows: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    for t in tensors:
        n = t.numel()
        # Low-precision leaves at any size: inductor converts them in registers, the eager code through a buffer.
        converted = _acc_dtype(t.dtype, overflow_safe) != t.dtype
        banded = kind.op == "sum" and n > ROWS_FROM and (n <= TRACED_ROWS or converted) and t.is_contiguous()
        (rows if banded else rest).append(t)
    parts = [_combine(*_traced(rows, kind, overflow_safe), kind)] if rows else []
    if rest:
        parts.append(_cpu_statistic(rest, kind.p, kind.op, overflow_safe))
    return parts[0] if len(parts) == 1 else kind.combine(torch.stack(parts))


@implements("cpu_statistic")
def _eager_cpu_statistic(tensors: list[torch.Tensor], p: float, op: str, overflow_safe: bool) -> torch.Tensor:
    """The eager CPU path as one op in a compiled graph: :func:`bucket_statistic` of CPU ``tensors``.

    Traced, a CPU bucket is this one opaque op (``_base.ops``), run at step time by
    the code the eager clip runs (scratch buffer, packing, row norms), rather
    than a reduction that inductor generates and compiles for each leaf,
    whose compile time grows with the leaf count for no gain in speed or
    accuracy. Its only output is a new 0-dim tensor; it reads the gradients
    and writes none.
    """
    kind = NormKind(p, op)
    norms, stats = _EagerCpu(kind, overflow_safe, in_graph=True).run(tensors)
    return _combine(norms, stats, kind)


_cpu_statistic = torch.ops.ppclip_func.cpu_statistic.default


def _combine(norms: list[torch.Tensor], stats: list[torch.Tensor], kind: NormKind) -> torch.Tensor:
    """One bucket's 0-dim float64 statistic from its norms (to be raised to ``p``) and ready statistics."""
    parts = [kind.power(_flat64(norms))] if norms else []
    if stats:
        # Max entries may come from aminmax, signed; every other statistic is already >= 0.
        parts.append(_flat64(stats).abs() if kind.op == "max" else _flat64(stats))
    return kind.combine(parts[0] if len(parts) == 1 else torch.cat(parts))


def _flat64(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The 0-dim and 1-D ``pieces`` as one float64 vector, with as few calls as possible."""
    if len(pieces) == 1 and pieces[0].dim() == 1:
        return pieces[0].to(STAT_DTYPE)
    if len({(p.dtype, p.dim()) for p in pieces}) == 1 and pieces[0].dim() == 1:  # row norms of many leaves
        return torch.cat(pieces).to(STAT_DTYPE)
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = defaultdict(lambda: ([], []))
    for p in pieces:
        scalars, vectors = by_dtype[p.dtype]
        (vectors if p.dim() else scalars).append(p)
    parts = []
    for scalars, vectors in by_dtype.values():
        if scalars:
            vectors.append(torch.stack(scalars))
        parts.append((vectors[0] if len(vectors) == 1 else torch.cat(vectors)).to(STAT_DTYPE))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _foreach_norms(items: list[torch.Tensor], dtype: torch.dtype, kind: NormKind, overflow_safe: bool) -> torch.Tensor:
    """The norms of whole leaves of one ``dtype``, as a vector, from one ``_foreach_norm`` call.

    Max and min are exact in the grads' own dtype; sums and counts need the accumulation dtype.
    """
    acc = _acc_dtype(dtype, overflow_safe) if kind.op == "sum" else dtype
    return torch.stack(torch._foreach_norm(items, kind.p, dtype=None if acc == dtype else acc))


def _acc_dtype(dtype: torch.dtype, overflow_safe: bool) -> torch.dtype:
    # Not torch.promote_types: that is a dispatched op, a microsecond per leaf. Grads are real floating point.
    return torch.float64 if overflow_safe or dtype == torch.float64 else torch.float32


@per_process
@functools.cache
def _row_width(n: int) -> int:
    """The longest row, of ``ROW // 8`` to ``ROW`` elements, that divides ``n`` (0 if none does).

    Rows that tile a leaf exactly make its row-wise norm one op, with no
    last partial row to reduce apart; any width in that range keeps every
    accumulation as short as ``ROW`` or shorter.
    """
    for width in range(ROW, ROW // 8 - 1, -1):
        if n % width == 0:
            return width
    return 0


def _dense_view(t: torch.Tensor) -> torch.Tensor:
    """Returns ``t`` with its dims permuted into memory order (outermost first).

    A norm does not depend on element order, so a transposed gradient is
    reduced in the order its storage holds it, and is contiguous then.
    """
    if t.is_contiguous() or t.dim() < 2:
        return t
    strides = t.stride()
    return t.permute(sorted(range(t.dim()), key=lambda d: -strides[d]))


# --- eager, CPU ------------------------------------------------------------------------------


class _EagerCpu:
    """One bucket's statistics in eager mode on CPU: norms (to be raised to ``p``) and ready statistics."""

    def __init__(self, kind: NormKind, overflow_safe: bool, *, in_graph: bool = False) -> None:
        self.kind = kind
        self.overflow_safe = overflow_safe
        # Eagerly, large leaves' row norms run on the calling thread, as torch's norm of a whole leaf does.
        # In a compiled graph (the op), inductor's own reductions, torch's compiled norm among them, use
        # every thread, and the rows do too.
        self.row_threads = contextlib.nullcontext if in_graph else _calling_thread_only
        self.norms: list[torch.Tensor] = []
        self.stats: list[torch.Tensor] = []
        self.streams: dict[torch.dtype, _Stream] = {}

    def run(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        kind, safe = self.kind, self.overflow_safe
        # Leaves reduced whole by one foreach call per input dtype.
        whole: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        if kind.op == "sum" and kind.p == 2.0:
            self._sums_of_squares(tensors, whole)
        elif kind.op != "sum":  # max and min are exact in any dtype and order
            for t in tensors:
                if t.numel() <= BLOCK:
                    whole[t.dtype].append(t)
                elif kind.op == "max":
                    self.stats.extend(torch.aminmax(t))
                else:
                    self._stream(_acc_dtype(t.dtype, safe)).add(t)
        elif kind.p == 0.0:  # counts, exact in fp32 up to 2^24
            for t in tensors:
                if t.numel() <= COUNT_WHOLE:
                    whole[t.dtype].append(t)
                else:
                    self.stats.append(torch.count_nonzero(t))
        else:
            for t in tensors:
                self._stream(_acc_dtype(t.dtype, safe)).add(t)
        for stream in self.streams.values():
            stream.flush()
        for dtype, items in whole.items():
            if items:
                self.norms.append(_foreach_norms(items, dtype, kind, safe))
        return self.norms, self.stats

    def _sums_of_squares(self, tensors: list[torch.Tensor], whole: dict[torch.dtype, list[torch.Tensor]]) -> None:
        """2-norms. Leaves in their accumulation dtype (fp32, fp64) are read in place, by size:

        up to ``WHOLE`` elements whole in the foreach call; below ``ROWS_FROM``
        packed side by side into the scratch buffer by one ``cat`` per block
        and reduced in rows of ``ROW`` (a norm op per leaf would cost more
        than the copy); larger ones row-wise in place, one op each, their
        last partial row packed with the others. No accumulation covers more
        than ``ROW`` elements, whatever the CPU, its BLAS or the thread
        count. The rest (bf16/fp16, strided leaves) goes through the scratch
        buffer.
        """
        own = (torch.float64,) if self.overflow_safe else (torch.float32, torch.float64)
        layouts = {(t.dtype, t.is_contiguous()) for t in tensors}  # one pass over the leaves
        dtype, contiguous = next(iter(layouts))
        if len(layouts) == 1 and contiguous and dtype not in own:
            # One dtype that is not its own accumulation dtype (bf16, fp16; fp32 with overflow_safe), all
            # contiguous: converted through the scratch buffer, small leaves (those _Stream.add would leave
            # pending) packed by one cat per block, with no per-leaf branching.
            stream = self._stream(_acc_dtype(dtype, self.overflow_safe))
            small = []
            for t, n in zip(tensors, map(torch.Tensor.numel, tensors)):
                if n <= CAT_LIMIT:
                    small.append(t if t.dim() == 1 else t.view(-1))
                else:
                    stream.add(t)
            if small:
                stream.pack(small)
            return
        if len(layouts) == 1 and contiguous and dtype in own:
            # One dtype, all contiguous (the common case): sorted by size with no per-leaf branching.
            sizes = list(map(torch.Tensor.numel, tensors))
            if max(sizes) <= WHOLE:
                whole[dtype].extend(tensors)
                return
            whole[dtype].extend(t for t, n in zip(tensors, sizes) if n <= WHOLE)
            packed = [t if t.dim() == 1 else t.view(-1) for t, n in zip(tensors, sizes) if WHOLE < n < ROWS_FROM]
            with self.row_threads():  # once for all the large leaves: a few us a switch
                for t, n in zip(tensors, sizes):
                    if n >= ROWS_FROM:
                        packed.extend(self._rows(t, n))
            if packed:
                self._stream(dtype).pack(packed)
            return
        for t in tensors:
            dtype, n = t.dtype, t.numel()
            dense = t if t.is_contiguous() else _dense_view(t)
            if dtype not in own or not (n <= ROW or dense.is_contiguous()):
                self._stream(_acc_dtype(dtype, self.overflow_safe)).add(t)
            elif n <= WHOLE:
                whole[dtype].append(t)
            elif n < ROWS_FROM:
                self._stream(dtype).add(dense)
            else:
                with self.row_threads():
                    self._stream(dtype).pending.extend(self._rows(dense, n))

    def _rows(self, t: torch.Tensor, n: int) -> list[torch.Tensor]:
        """One row-wise norm over a contiguous leaf of ``n`` elements, read in place.

        Rows tile the leaf when some width of ``ROW // 8`` to ``ROW`` divides
        ``n`` (one view, one op); else they are ``ROW`` long and the last
        partial row is returned, to be packed with the medium leaves.

        Callers run it under ``row_threads``: eagerly on the calling thread
        only, as torch's own norm of a whole leaf runs at any size
        (:func:`_calling_thread_only`).
        """
        width = _row_width(n)
        if width:
            self.norms.append(torch.linalg.vector_norm(t.view(n // width, width), 2, 1))
            return []
        flat, rows = t.view(-1), n // ROW
        self.norms.append(torch.linalg.vector_norm(flat[: rows * ROW].view(rows, ROW), 2, 1))
        return [flat[rows * ROW :]]

    def _stream(self, acc: torch.dtype) -> _Stream:
        if acc not in self.streams:
            self.streams[acc] = _Stream(self, _scratch(acc))
        return self.streams[acc]

    def reduce_block(self, block: torch.Tensor) -> None:
        """Adds the statistics of a filled 1-D scratch block (it may be overwritten)."""
        kind = self.kind
        if kind.op == "sum" and kind.p == 2.0:
            rows = block.numel() // ROW
            if rows:
                self.norms.append(torch.linalg.vector_norm(block[: rows * ROW].view(rows, ROW), dim=1))
            if block.numel() > rows * ROW:
                self.norms.append(torch.linalg.vector_norm(block[rows * ROW :]))
        elif kind.op == "sum" and kind.p == 0.0:
            self.stats.append(torch.count_nonzero(block))
        elif kind.op == "sum":
            block.abs_()
            if kind.p != 1.0:
                block.pow_(kind.p)
            self.stats.append(block.sum())  # a cascade sum: accurate at any length
        else:
            block.abs_()
            self.stats.append(block.amax() if kind.op == "max" else block.amin())


class _Stream:
    """Feeds leaves through a scratch buffer in the accumulation dtype, one block at a time.

    The full blocks of a large dense leaf are copied (converted) straight into
    the buffer and reduced at once. Everything else (small leaves, the tails
    of large ones, pieces of strided leaves) waits until :meth:`flush`, which
    packs it side by side: runs of contiguous items by one ``cat``, strided
    pieces (at most ``BLOCK`` elements each, cut along the outermost dims in
    memory order) by one ``copy_`` each. A strided leaf is never copied whole.
    """

    def __init__(self, owner: _EagerCpu, buf: torch.Tensor) -> None:
        self.owner = owner
        self.buf = buf
        self.pending: list[torch.Tensor] = []

    def add(self, t: torch.Tensor) -> None:
        n = t.numel()
        if n <= ROW or (n <= CAT_LIMIT and t.is_contiguous()):
            self.pending.append(t.reshape(-1))
            return
        t = _dense_view(t)
        if not t.is_contiguous():
            self.pending.extend(_pieces(t, BLOCK))
            return
        flat = t.view(-1)
        full = n - n % BLOCK
        for a in range(0, full, BLOCK):
            self.buf.copy_(flat[a : a + BLOCK])
            self.owner.reduce_block(self.buf)
        if full < n:
            self.pending.append(flat[full:])

    def pack(self, flats: list[torch.Tensor]) -> None:
        """Reduces contiguous 1-D tensors of one dtype, at most ``BLOCK`` elements each, packed side by side.

        One ``cat`` per block into the buffer, then one row-wise norm: no op,
        and little Python, per tensor. On the calling thread only
        (:func:`_calling_thread_only`).
        """
        with _calling_thread_only():
            self._pack(flats)

    def _pack(self, flats: list[torch.Tensor]) -> None:
        buf, start, fill = self.buf, 0, 0
        for i, n in enumerate(map(torch.Tensor.numel, flats)):
            if fill + n > BLOCK:
                self._put(flats[start:i], 0, fill)
                self.owner.reduce_block(buf[:fill])
                start, fill = i, 0
            fill += n
        self._put(flats[start:], 0, fill)
        self.owner.reduce_block(buf[:fill])

    def flush(self) -> None:
        """Reduces the pending items, packed side by side, on the calling thread only."""
        if self.pending:
            with _calling_thread_only():
                self._flush()
        self.pending = []

    def _flush(self) -> None:
        buf, fill, run_at = self.buf, 0, 0
        run: list[torch.Tensor] = []
        for item in self.pending:
            n = item.numel()
            packable = item.dim() == 1 and item.is_contiguous()
            full = fill + n > BLOCK
            if run and (full or not packable or item.dtype != run[0].dtype):
                self._put(run, run_at, fill)
                run = []
            if full:
                self.owner.reduce_block(buf[:fill])
                fill = 0
            if packable:
                if not run:
                    run_at = fill
                run.append(item)
            else:
                buf[fill : fill + n].view(item.shape).copy_(item)
            fill += n
        if run:
            self._put(run, run_at, fill)
        if fill:
            self.owner.reduce_block(buf[:fill])

    def _put(self, run: list[torch.Tensor], start: int, end: int) -> None:
        """Writes contiguous 1-D tensors of one dtype side by side into ``buf[start:end]``.

        Tensors of another dtype (bf16, fp16) are packed by a ``cat`` in their
        own dtype into a staging buffer, then converted by one copy: a ``cat``
        that converts runs a copy kernel per input.
        """
        if run[0].dtype == self.buf.dtype or len(run) == 1:
            torch.cat(run, out=self.buf[start:end])
            return
        staged = _scratch(run[0].dtype)[: end - start]
        torch.cat(run, out=staged)
        self.buf[start:end].copy_(staged)


@contextlib.contextmanager
def _calling_thread_only() -> Iterator[None]:
    """Runs torch's CPU ops on the calling thread alone inside the block, as with one torch thread.

    The packed blocks of small leaves are ``BLOCK`` elements, over which
    torch's kernels split the work across its threads: a parallel region per
    op, whose end waits for every thread. torch's own clip reduces such
    leaves one by one, each under ``at::internal::GRAIN_SIZE`` (32768), so
    on the calling thread. The regions cost time on an idle machine and wait
    for a busy core on a shared one (bench/busy_study.py); smaller blocks
    avoid them but double the ops. The row norm of a large dense leaf is
    kept on the calling thread too: torch's norm of a whole leaf never
    leaves it. ``torch.set_num_threads`` sets OpenMP's count for the calling
    thread (and the default for threads that start torch later), cheaply;
    the count is restored.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _pieces(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Views that partition ``t``, each of at most ``limit`` elements, cut along the leading dims."""
    if t.numel() <= limit:
        yield t
        return
    if t.dim() == 1:
        for a in range(0, t.shape[0], limit):
            yield t[a : a + limit]
        return
    inner = t.numel() // t.shape[0]
    if inner > limit:
        for i in range(t.shape[0]):
            yield from _pieces(t[i], limit)
        return
    step = limit // inner
    for a in range(0, t.shape[0], step):
        yield t[a : a + step]


def _scratch(dtype: torch.dtype) -> torch.Tensor:
    """This thread's reusable CPU scratch buffer of ``BLOCK`` elements of ``dtype``."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    buf = buffers.get(dtype)
    if buf is None:
        # A normal tensor even when first made under inference_mode, so that later calls may write it.
        with torch.inference_mode(False):
            buf = buffers[dtype] = torch.empty(BLOCK, dtype=dtype)
    return buf


# --- traced (torch.compile) and non-CPU devices ----------------------------------------------


def _traced(
    tensors: list[torch.Tensor], kind: NormKind, overflow_safe: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Norms (to be raised to ``p``) and ready statistics, in shape-static code with no scratch buffer.

    For accelerators, eager and traced. Leaves that one
    ``_foreach_norm`` reduces within our precision (:func:`_foreach_limit`:
    small ones, and every leaf on a ``BLOCKWISE_FOREACH`` device) share one
    call per dtype, which stays one call to torch's kernel under inductor.
    Every other dense leaf is viewed whole as rows of ``ROW // 8`` to ``ROW``
    elements (:func:`_row_width`; traced, or if none divides it, rows of
    ``ROW`` and a last partial one) and reduced row-wise by one
    ``vector_norm``: no copy, and one
    reduction per leaf that inductor generates itself, with accumulations
    as short as the eager path's. (Cutting leaves into foreach pieces would
    give thousands of 0-dim outputs, each a copy in the kernel and a line of
    Python in inductor's wrapper.) A strided
    leaf gets one ``vector_norm`` over each index of its outermost dim.
    """
    norms: list[torch.Tensor] = []
    whole: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    limits = {d: _foreach_limit(d, kind, overflow_safe, tensors[0].device) for d in {t.dtype for t in tensors}}
    for t in tensors:
        acc = _acc_dtype(t.dtype, overflow_safe)
        n = t.numel()
        if n <= limits[t.dtype]:
            whole[t.dtype].append(t)
            continue
        t = _dense_view(t)
        if t.is_contiguous() and n >= ROW:
            # Traced, rows of ROW and a last partial row: the size may be symbolic (a DTensor's local
            # shard), and dynamo would trace _row_width's loop of up to 1,800 steps into the compile time.
            width = ROW if torch.compiler.is_compiling() else _row_width(n) or ROW
            flat = t.view(-1)
            rows = n // width
            norms.append(torch.linalg.vector_norm(flat[: rows * width].view(rows, width), kind.p, dim=1, dtype=acc))
            t = flat[rows * width :]
            if t.numel() == 0:
                continue
        dims = tuple(range(1, t.dim())) if t.dim() > 1 else None
        norms.append(torch.linalg.vector_norm(t, kind.p, dim=dims, dtype=acc))
    norms.extend(_foreach_norms(items, dtype, kind, overflow_safe) for dtype, items in whole.items())
    return norms, []
