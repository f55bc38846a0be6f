"""The clip's statistics recorded every step with no host sync, and the parameters behind a spike.

When a run's loss spikes, the first question is which layers' gradients blew
up and whether the clip caught it. The clip's one all-reduce already gives
every rank the total norm, the threshold, the z-score, the skip decision and,
with ``param_norms=index``, every parameter's norm. :class:`ClipRecorder`
keeps them without reading anything on the host inside the step:

* **In the step** (eager, ``torch.compile``d or captured in a CUDA graph),
  :meth:`ClipRecorder.record` computes one row on the device (total,
  threshold, z-score, clip coefficient, clipped, skipped, the ``top_k``
  parameters whose norm is furthest above their own running statistics, and
  every parameter's norm) and writes it into a ring of rows on the device at
  a device-side counter, then updates the per-parameter statistics. Every
  write is one op that declares what it mutates, so a compiled step is right
  whatever it returns; no collective, no host read, the same kernels every
  step.
* **Outside the step**, :meth:`ClipRecorder.flush` starts one non-blocking
  copy of the ring into pinned host memory (on a GPU; on a CPU the ring is
  read where it is), and :meth:`ClipRecorder.read` returns the rows whose
  copy has finished as :class:`StepRecord` objects, without waiting unless
  asked to: call ``flush()`` after each step and ``read()`` one step later,
  or both at the end of a logging interval.

A step is *anomalous* when it was clipped (its coefficient below 1) or
skipped; only then does its record name the parameters behind it
(``spiked``). Each parameter's running statistics (a mean and variance of
its norm: the plain ones over the first ``warmup`` steps, then exponential
with weight ``alpha``, as ZClip keeps the total's) take in every step that is
not skipped, on the device, and are saved with the recorder's
``state_dict()`` (a ``Stateful``: ``dcp.save``/``load``, torchtitan's
checkpoints), by parameter name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.stateful import Stateful

from .._base.ops import implements
from .._core.param_norms import ParamIndex
from .adaptive import ClipStats
from .write_back import copy_into_

__all__ = ["ClipRecorder", "ParamNormStats", "StepRecord"]

_STAT = torch.float64
# The fixed head of a row; then top_k indices, top_k z-scores, and the parameters' norms.
_HEAD = ("total", "threshold", "zscore", "clip_coef", "clipped", "skipped")


class ParamNormStats(NamedTuple):
    """Each parameter's running statistics of its gradient norm, on the device.

    Attributes:
        count: 0-dim int64: the steps taken in (skipped steps are not).
        mean: ``(N,)`` float64, in ``index.names`` order.
        var: ``(N,)`` float64 (population variance).
    """

    count: torch.Tensor  # type: ignore[assignment]  # the public field's name shadows tuple.count
    mean: torch.Tensor
    var: torch.Tensor


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step as recorded: plain Python values, read on the host after the step.

    Attributes:
        step: The step's number, counting from 1: how many steps the
            recorder has recorded, this one included (from the start of the
            run, across restarts).
        total: The global norm before clipping.
        threshold: The norm the step clipped to (``inf`` without one).
        zscore: The total's z-score against the clip's statistics (``nan``
            without them).
        clip_coef: ``min(1, threshold / (total + eps))``.
        clipped: The coefficient was below 1 (and the step not skipped).
        skipped: The step was not applied.
        param_norms: Every parameter's norm by name, or ``None`` without an
            index.
        spiked: On a clipped or skipped step, the parameters whose norm is
            furthest above their own running statistics (up to ``top_k``,
            each with a positive z-score), largest first, as
            ``{"name", "zscore", "norm"}``; ``[]`` otherwise.
    """

    step: int
    total: float
    threshold: float
    zscore: float
    clip_coef: float
    clipped: bool
    skipped: bool
    param_norms: dict[str, float] | None
    spiked: list[dict[str, Any]]

    @property
    def anomalous(self) -> bool:
        """The step was clipped or skipped."""
        return self.clipped or self.skipped

    def metrics(self, prefix: str = "grad_norm") -> dict[str, float]:
        """A flat dict of scalars, named for a logger: ``{prefix}/total``, ``{prefix}/<parameter name>``, ...

        What a trainer passes straight to its logger (TensorBoard's
        ``add_scalar`` per key, ``wandb.log(metrics, step=record.step)``,
        torchtitan's metrics processor's ``logger.log(metrics, step)``).
        """
        out = {f"{prefix}/{k}": float(getattr(self, k)) for k in _HEAD}
        for name, norm in (self.param_norms or {}).items():
            out[f"{prefix}/{name}"] = norm
        return out

    def to_json(self) -> str:
        """This record as one JSON line (``NaN`` and ``Infinity`` as Python's ``json`` writes them)."""
        return json.dumps(dataclasses.asdict(self))


class ClipRecorder(Stateful):
    """Records each step's clip statistics on the device; reads them on the host later, with no sync in the step.

    Args:
        index: The :class:`ParamIndex` the clip is given as ``param_norms=``
            (every parameter's norm is then recorded, and the parameters
            behind a spike named), or ``None`` for the total alone.
        capacity: Rows kept on the device: at most this many steps between
            two reads (older ones are dropped with a warning).
        top_k: How many parameters an anomalous step names.
        warmup: Steps over which each parameter's statistics are the plain
            mean and variance; exponential after.
        alpha: The exponential statistics' weight of the past, as ZClip's.
        eps: Added to the norm in the coefficient and to the standard
            deviation in the z-scores.
        device: Where the grads live (``None``: the default device).
        path: A JSON Lines file that :meth:`read` appends each record to
            (``None``: none).

    Raises:
        ValueError: ``capacity`` or ``top_k`` is not positive, ``warmup`` is
            negative, or ``alpha`` is not in ``[0, 1)``.

    Example:
        >>> import torch
        >>> from ppclip_func import ClipRecorder, adaptive_clip_grad_norm_, init_clip_state, param_norm_index
        >>> params = {"w": torch.nn.Parameter(torch.zeros(4)), "b": torch.nn.Parameter(torch.zeros(1))}
        >>> index = param_norm_index(params, None)
        >>> recorder = ClipRecorder(index, top_k=1, warmup=3)
        >>> state = init_clip_state()
        >>> for step in range(6):
        ...     params["w"].grad = torch.full((4,), 0.5 if step < 5 else 50.0)  # a spike in w at the last step
        ...     params["b"].grad = torch.full((1,), 0.1)
        ...     stats = adaptive_clip_grad_norm_(params, None, state, max_norm=5.0, warmup=3, param_norms=index)
        ...     state = stats.state
        ...     recorder.record(stats)  # on the device: nothing read on the host
        >>> recorder.flush()  # outside the step: one copy to the host
        >>> last = recorder.read()[-1]
        >>> last.step, last.clipped, [s["name"] for s in last.spiked]
        (6, True, ['w'])
        >>> last.metrics()["grad_norm/w"]
        100.0
    """

    def __init__(
        self,
        index: ParamIndex | None = None,
        *,
        capacity: int = 256,
        top_k: int = 3,
        warmup: int = 10,
        alpha: float = 0.97,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        path: str | os.PathLike | None = None,
    ) -> None:
        if capacity < 1 or top_k < 1 or warmup < 0 or not 0.0 <= alpha < 1.0:
            raise ValueError(
                f"capacity and top_k must be positive, warmup >= 0 and 0 <= alpha < 1; got capacity={capacity}, "
                f"top_k={top_k}, warmup={warmup}, alpha={alpha}"
            )
        device = torch.device(device) if device is not None else torch.get_default_device()
        self.index = index
        self.names = index.names if index is not None else ()
        n = self._n = len(self.names)
        self.top_k = min(top_k, n) if n else 0
        self.capacity, self.warmup, self.alpha, self.eps = capacity, warmup, alpha, eps
        self.path = None if path is None else os.fspath(path)
        self.width = len(_HEAD) + 2 * self.top_k + n
        self._ring = torch.zeros(capacity, self.width, dtype=_STAT, device=device)
        self._count = torch.zeros((), dtype=torch.int64, device=device)
        self.stats = ParamNormStats(
            torch.zeros((), dtype=torch.int64, device=device),
            torch.zeros(n, dtype=_STAT, device=device),
            torch.zeros(n, dtype=_STAT, device=device),
        )
        on_host = device.type == "cpu"
        # On a CPU the ring is read where it is; elsewhere a pinned copy receives it without blocking.
        self._host_ring = self._ring if on_host else torch.empty_like(self._ring, device="cpu").pin_memory()
        self._host_count = self._count if on_host else torch.empty_like(self._count, device="cpu").pin_memory()
        self._event: torch.Event | None = None
        self._read_upto: int | None = None  # records up to this step have been returned by read()

    # -----------------------------------------------------------------------------------------
    # In the step: device work only
    # -----------------------------------------------------------------------------------------

    def record(
        self,
        stats: ClipStats | torch.Tensor,
        *,
        threshold: float | torch.Tensor | None = None,
        param_norms: torch.Tensor | None = None,
    ) -> None:
        """Records one step: a row into the device ring, and the per-parameter statistics updated.

        Nothing is read on the host, no collective is issued, and the same
        ops run every step (whatever the values: a spike, a NaN), so a
        compiled or captured step holds it whole.

        Args:
            stats: The step's :class:`ClipStats` (the adaptive clips), or the
                total norm a plain clip returned.
            threshold: With a plain total norm, the ``max_norm`` it clipped
                to (``None``: no threshold); ignored with ``ClipStats``.
            param_norms: With a plain total norm, the per-parameter norms in
                ``index.names`` order (``None``: none); ignored with
                ``ClipStats``, whose ``param_norms`` are taken.

        Raises:
            ValueError: The recorder has an index and the step brings no
                per-parameter norms (pass ``param_norms=index`` to the clip),
                or they do not match the index.
        """
        limit: float | torch.Tensor
        if isinstance(stats, ClipStats):
            total, limit, zscore, skip, norms = (
                stats.total_norm, stats.threshold, stats.zscore, stats.skip, stats.param_norms,
            )  # fmt: skip
        else:
            total, norms = stats, param_norms
            limit = math.inf if threshold is None else threshold
            zscore, skip = None, None
        n = self._n  # an int: the names themselves are not read in the step (a traced step would guard on each)
        if n and (norms is None or norms.shape != (n,)):
            got = None if norms is None else tuple(norms.shape)
            raise ValueError(
                f"this recorder names {n} parameters: give the clip param_norms=index (the "
                f"recorder's), so its stats carry one norm per name; got per-parameter norms of shape {got}"
            )
        device = self._ring.device
        total = _as_stat(total, device)
        if isinstance(limit, torch.Tensor):
            limit = _as_stat(limit, device)
        else:  # a fill, not a copy from the host
            limit = torch.full((), float(limit), dtype=_STAT, device=device)
        zscore = torch.full_like(total, math.nan) if zscore is None else _as_stat(zscore, device)
        skipped = torch.zeros_like(total, dtype=torch.bool) if skip is None else skip.detach().to(device)
        coef = torch.clamp(limit / (total + self.eps), max=1.0)
        clipped = (coef < 1.0) & ~skipped
        head = torch.stack([total, limit, zscore, coef, clipped, skipped])  # stack promotes the flags to float64
        if not n or norms is None:  # with n names, norms is not None (checked above)
            _write(self._ring, self._count, head, [], [])
            return
        norms = _as_stat(norms, device)
        mean, var, count = self.stats.mean, self.stats.var, self.stats.count
        d = norms - mean
        z = torch.where(count >= 2, d / (var.sqrt() + self.eps), -math.inf)  # -inf: never among the top
        top_z, top_i = torch.topk(z.nan_to_num(nan=-math.inf), self.top_k)
        row = torch.cat([head, top_i, top_z, norms])
        # The statistics take in every step that is not skipped, each parameter where its norm is finite:
        # with weight w = 1 / n over the warm-up (Welford's plain mean and variance), 1 - alpha after.
        warm = count < self.warmup
        w = torch.where(warm, 1.0 / (count + 1), 1.0 - self.alpha)
        new_mean = mean + w * d
        e = norms - new_mean
        new_var = (1.0 - w) * var + w * e * torch.where(warm, d, e)
        take = torch.isfinite(norms) & ~skipped
        new_count = count + (~skipped).to(count.dtype)
        new_stats = [new_count, torch.where(take, new_mean, mean), torch.where(take, new_var, var)]
        _write(self._ring, self._count, row, [count, mean, var], new_stats)

    # -----------------------------------------------------------------------------------------
    # Outside the step: the host
    # -----------------------------------------------------------------------------------------

    @torch.compiler.disable
    def flush(self) -> None:
        """Starts copying the recorded rows to the host, without waiting (call it outside the step)."""
        if self._host_ring is self._ring:
            return
        self._host_ring.copy_(self._ring, non_blocking=True)
        self._host_count.copy_(self._count, non_blocking=True)
        event = torch.Event(self._ring.device)
        event.record()
        self._event = event

    @torch.compiler.disable
    def read(self, wait: bool = False) -> list[StepRecord]:
        """Returns the records not read before whose copy to the host has finished (see :meth:`flush`).

        Args:
            wait: Wait for the last :meth:`flush`'s copy to finish (a host
                sync) instead of returning nothing while it runs.

        Returns:
            The new records, in step order; also appended to ``path`` as
            JSON lines where the recorder has one.
        """
        if self._event is not None and not self._event.query():
            if not wait:
                return []
            self._event.synchronize()
        count = int(self._host_count)
        first = max(count - self.capacity, 0)
        start = first if self._read_upto is None else max(self._read_upto, first)
        if self._read_upto is not None and self._read_upto < first:
            warnings.warn(
                f"ClipRecorder: {first - self._read_upto} steps were recorded and dropped before they were read "
                f"(capacity {self.capacity}): read (or flush and read) at least every {self.capacity} steps",
                RuntimeWarning,
                stacklevel=2,
            )
        slots = [i % self.capacity for i in range(start, count)]
        rows = self._host_ring[slots].tolist() if slots else []
        records = [self._decode(i + 1, row) for i, row in zip(range(start, count), rows)]
        self._read_upto = count
        if self.path is not None and records:
            with open(self.path, "a") as f:
                f.writelines(r.to_json() + "\n" for r in records)
        return records

    def _decode(self, step: int, row: list[float]) -> StepRecord:
        total, threshold, zscore, coef, clipped, skipped = row[: len(_HEAD)]
        k, n = self.top_k, len(self.names)
        top_i = row[len(_HEAD) : len(_HEAD) + k]
        top_z = row[len(_HEAD) + k : len(_HEAD) + 2 * k]
        norms = row[len(_HEAD) + 2 * k :]
        anomalous = bool(clipped) or bool(skipped)
        spiked = (
            [
                {"name": self.names[int(i)], "zscore": z, "norm": norms[int(i)]}
                for i, z in zip(top_i, top_z)
                if math.isfinite(z) and z > 0.0  # above its own statistics: a slightly clipped step may have none
            ]
            if anomalous and n
            else []
        )
        return StepRecord(
            step=step,
            total=total,
            threshold=threshold,
            zscore=zscore,
            clip_coef=coef,
            clipped=bool(clipped),
            skipped=bool(skipped),
            param_norms=dict(zip(self.names, norms)) if n else None,
            spiked=spiked,
        )

    # -----------------------------------------------------------------------------------------
    # Checkpoints
    # -----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"steps", "count", "mean": {name: 0-dim}, "var": {name: 0-dim}}``: copies, keyed by parameter name."""
        mean, var = self.stats.mean.detach().clone(), self.stats.var.detach().clone()
        return {
            "steps": self._count.detach().clone(),
            "count": self.stats.count.detach().clone(),
            "mean": dict(zip(self.names, mean.unbind())),
            "var": dict(zip(self.names, var.unbind())),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores the step counter and the per-parameter statistics, by name, into the recorder's tensors.

        Raises:
            ValueError: The keys or the parameter names differ from this
                recorder's (the missing and unknown names are named).
        """
        keys = {"steps", "count", "mean", "var"}
        if not isinstance(state_dict, Mapping) or set(state_dict) != keys:
            got = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(f"state_dict must have the keys {sorted(keys)}, got {got}")
        for key in ("mean", "var"):
            given = state_dict[key]
            missing = [n for n in self.names if n not in given]
            unknown = sorted(set(given) - set(self.names))
            if missing or unknown:
                raise ValueError(
                    f"state_dict[{key!r}] does not name this recorder's parameters: missing {missing}, unknown {unknown}"
                )
        mean, var = self.stats.mean, self.stats.var

        def vector(key: str, like: torch.Tensor) -> torch.Tensor:
            values = [state_dict[key][n].detach().to(like) for n in self.names]
            return torch.stack(values) if values else torch.zeros_like(like)

        copy_into_(
            [self._count, self.stats.count, mean, var],
            [
                state_dict["steps"].detach().to(self._count),
                state_dict["count"].detach().to(self.stats.count),
                vector("mean", mean),
                vector("var", var),
            ],
        )
        self._read_upto = None

    def __repr__(self) -> str:
        return f"ClipRecorder({len(self.names)} parameters, capacity={self.capacity}, top_k={self.top_k})"


def _as_stat(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` detached, as float64 on ``device`` (no ``Tensor.to`` call where it already is: a dispatched op)."""
    t = t.detach()
    return t if t.dtype == _STAT and t.device == device else t.to(device=device, dtype=_STAT)


@implements("record_")
def _record(
    ring: torch.Tensor, count: torch.Tensor, row: torch.Tensor, stats: list[torch.Tensor], new_stats: list[torch.Tensor]
) -> None:
    """``ring[count % len(ring)] = row; count += 1`` on the device (the slot is never read on the host), then
    ``stats[i] = new_stats[i]``."""
    slot = torch.remainder(count, ring.shape[0]).reshape(1)
    ring.index_copy_(0, slot, row.reshape(1, -1).to(ring.dtype))
    count.add_(1)
    if stats:
        torch._foreach_copy_(stats, new_stats)


# _record as one op that declares what it writes: a compiled graph runs it after every kernel that reads
# the counter or the statistics, whatever the step returns (ppclip_func/_clip/write_back.py).
_record_ = torch.ops.ppclip_func.record_.default


def _write(
    ring: torch.Tensor, count: torch.Tensor, row: torch.Tensor, stats: list[torch.Tensor], new_stats: list[torch.Tensor]
) -> None:
    """The step's one write: through the op where traced; eager ops run in program order."""
    (_record_ if torch.compiler.is_compiling() else _record)(ring, count, row, stats, new_stats)
