"""The adaptive clip's state as a ``Stateful``: saved and restored with the rest of a run.

``torch.distributed.checkpoint`` (``dcp.save`` / ``dcp.load``) calls
``state_dict()`` and ``load_state_dict()`` on every ``Stateful`` value of the
dict it is given, on every rank; torchtitan's ``CheckpointManager`` passes
the Statefuls of its ``states`` argument on to it beside the model and the
optimizer. :class:`ClipStateful` is that object for a :class:`ClipState`.

:class:`AdaGCStateful` does the same for AdaGC's :class:`AdaGCState`, its
per-parameter running norms keyed by parameter name, so that a checkpoint
loads into another sharding or another split into pipeline stages (every
rank's index names every parameter of the whole model).

Both holders also keep the state where it is: :meth:`ClipStateful.update_`
writes a step's new state into the holder's own tensors, and
``load_state_dict()`` restores into them, so their storage never changes.
A step captured in a CUDA graph reads the state at the addresses it was
captured with; updated this way, inside the captured step, each replay
reads the state the previous one left (docs/cuda-graphs.md).

The state is three 0-dim tensors that every rank computes from the same
all-reduced norm, so they are bitwise identical on every rank: DCP saves
them as replicated tensors, once, and any number of ranks loads them, the
number that saved them or another.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from .._core.param_norms import ParamIndex
from .adagc import AdaGCState, init_adagc_state
from .adaptive import ClipState, init_clip_state
from .write_back import copy_into_

__all__ = ["AdaGCStateful", "ClipStateful"]

_KEYS = ClipState._fields  # ("count", "mean", "var")


class ClipStateful(Stateful):
    """Holds the adaptive clip's :class:`ClipState` for ``torch.distributed.checkpoint`` and torchtitan.

    Read ``clip.state`` for each step and store the step's ``stats.state``
    back, either by setting ``clip.state`` (the holder then holds the step's
    tensors) or with :meth:`update_` (the holder's tensors are written in
    place: what a step captured in a CUDA graph needs). Hand the holder to
    the checkpointer, which saves and loads it on every rank:
    ``state_dict()`` returns copies, and ``load_state_dict()`` writes into
    the holder's tensors, in their device and dtype.

    Args:
        device: Where the grads live, as :func:`init_clip_state`.
        dtype: Of the statistics, as :func:`init_clip_state`.

    Example:
        >>> import torch
        >>> from ppclip_func import ClipStateful, adaptive_clip_grad_norm_
        >>> clip = ClipStateful()
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> for step in range(3):
        ...     w.grad = torch.full((2,), 3.0 + step)
        ...     clip.state = adaptive_clip_grad_norm_([w], None, clip.state).state
        >>> saved = clip.state_dict()  # what dcp.save writes (or torchtitan's CheckpointManager(states={"clip": clip}))
        >>> saved
        {'count': tensor(3), 'mean': tensor(5.6569, dtype=torch.float64), 'var': tensor(1.3333, dtype=torch.float64)}
        >>> resumed = ClipStateful()
        >>> resumed.load_state_dict(saved)
        >>> all(torch.equal(a, b) for a, b in zip(resumed.state, clip.state))
        True
    """

    def __init__(self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float64) -> None:
        self.state = init_clip_state(device, dtype)

    @property
    def state(self) -> ClipState:
        """The statistics for the next step; set it to each step's ``stats.state``."""
        return self._state

    @state.setter
    def state(self, state: ClipState) -> None:
        if not isinstance(state, ClipState) or not all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in state):
            raise TypeError(f"state must be a ClipState of 0-dim tensors (a step's stats.state), got {state!r}")
        self._state = state

    def update_(self, state: ClipState) -> None:
        """Writes ``state``, a step's ``stats.state``, into the holder's tensors, in place.

        ``clip.state``'s tensors keep their storage, so a step captured in a
        CUDA graph (``torch.cuda.graph``) that reads ``clip.state`` and ends
        with ``clip.update_(stats.state)`` carries the statistics from one
        replay to the next. Inside a ``torch.compile``d step it is right
        whatever the step returns: the write is one op that declares what it
        mutates (:func:`~ppclip_func.write_back_`), which inductor runs after
        every read of the old statistics. One ``_foreach_copy_``, no host read.

        Raises:
            TypeError: ``state`` is not a :class:`ClipState` of 0-dim tensors
                of the holder's dtypes.

        Example:
            >>> import torch
            >>> from ppclip_func import ClipStateful, adaptive_clip_grad_norm_
            >>> clip = ClipStateful()
            >>> mean = clip.state.mean
            >>> w = torch.nn.Parameter(torch.zeros(2))
            >>> w.grad = torch.full((2,), 3.0)
            >>> clip.update_(adaptive_clip_grad_norm_([w], None, clip.state).state)
            >>> clip.state.mean is mean, mean
            (True, tensor(4.2426, dtype=torch.float64))
        """
        _copy_into(self._state, state, ClipState, "ClipState")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Returns ``{"count", "mean", "var"}``: copies of the state's 0-dim tensors."""
        return {key: t.detach().clone() for key, t in zip(_KEYS, self._state)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores the state from ``state_dict`` onto the holder's device, in its dtypes.

        Raises:
            TypeError: ``state_dict`` is not a mapping of tensors.
            ValueError: Its keys are not ``count``, ``mean`` and ``var``, or a
                tensor is not 0-dim.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        if set(state_dict) != set(_KEYS):
            raise ValueError(f"state_dict must have the keys {list(_KEYS)}, got {sorted(state_dict)}")
        for key in _KEYS:
            value = state_dict[key]
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"state_dict[{key!r}] must be a tensor, got {type(value).__name__}")
            if value.dim() != 0:
                raise ValueError(f"state_dict[{key!r}] must be a 0-dim tensor, got shape {tuple(value.shape)}")
        copy_into_(list(self._state), [state_dict[k].detach().to(own) for k, own in zip(_KEYS, self._state)])

    def __repr__(self) -> str:
        return f"ClipStateful({self._state!r})"


class AdaGCStateful(Stateful):
    """Holds AdaGC's :class:`AdaGCState` for ``torch.distributed.checkpoint`` and torchtitan, keyed by parameter name.

    ``state_dict()`` is ``{"count": 0-dim, "gamma": {parameter name: 0-dim}}``:
    every rank holds every parameter's ``gamma`` (computed from the same
    all-reduced norms, bitwise the same everywhere), so DCP saves each once,
    and a run whose index lists the same names in another order (another
    stage split, another sharding) loads it by name.

    Args:
        index: The :class:`ParamIndex` every step passes.
        device: Where the grads live, as :func:`init_adagc_state`.
        dtype: Of ``gamma``, as :func:`init_adagc_state`.

    Example:
        >>> import torch
        >>> from ppclip_func import AdaGCStateful, adagc_clip_grad_norm_, param_norm_index
        >>> params = {"w": torch.nn.Parameter(torch.zeros(2)), "b": torch.nn.Parameter(torch.zeros(1))}
        >>> clip = AdaGCStateful(param_norm_index(params, None))
        >>> params["w"].grad, params["b"].grad = torch.full((2,), 0.3), torch.full((1,), 0.1)
        >>> clip.state = adagc_clip_grad_norm_(params, None, clip.state, clip.index).state
        >>> saved = clip.state_dict()
        >>> saved["gamma"]
        {'w': tensor(0.4243, dtype=torch.float64), 'b': tensor(0.1000, dtype=torch.float64)}
        >>> resumed = AdaGCStateful(param_norm_index({"b": params["b"], "w": params["w"]}, None))  # another order
        >>> resumed.load_state_dict(saved)
        >>> resumed.state.gamma
        tensor([0.1000, 0.4243], dtype=torch.float64)
    """

    def __init__(
        self, index: ParamIndex, device: torch.device | str | None = None, dtype: torch.dtype = torch.float64
    ) -> None:
        self.index = index
        self.state = init_adagc_state(index, device, dtype)

    @property
    def state(self) -> AdaGCState:
        """The state for the next step; set it to each step's ``stats.state``, or :meth:`update_` it."""
        return self._state

    @state.setter
    def state(self, state: AdaGCState) -> None:
        if not isinstance(state, AdaGCState) or not all(isinstance(t, torch.Tensor) for t in state):
            raise TypeError(f"state must be an AdaGCState (a step's stats.state), got {state!r}")
        if state.count.dim() != 0 or state.gamma.shape != (len(self.index.names),):
            raise ValueError(
                f"state must have a 0-dim count and {len(self.index.names)} gammas (one per name of the index), "
                f"got shapes {tuple(state.count.shape)} and {tuple(state.gamma.shape)}"
            )
        self._state = state

    def update_(self, state: AdaGCState) -> None:
        """Writes ``state``, a step's ``stats.state``, into the holder's tensors, in place.

        As :meth:`ClipStateful.update_`: ``clip.state``'s tensors keep their
        storage, for a step captured in a CUDA graph.

        Raises:
            TypeError: ``state`` is not an :class:`AdaGCState` with the
                holder's shapes and dtypes.
        """
        _copy_into(self._state, state, AdaGCState, "AdaGCState")

    def state_dict(self) -> dict[str, Any]:
        """Returns ``{"count": 0-dim, "gamma": {name: 0-dim}}``: copies of the state's tensors."""
        gamma = self._state.gamma.detach().clone()
        return {"count": self._state.count.detach().clone(), "gamma": dict(zip(self.index.names, gamma.unbind()))}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores the state by parameter name, onto the holder's device, in its dtypes.

        Raises:
            TypeError: ``state_dict`` is not ``{"count": tensor, "gamma": {name: tensor}}``.
            ValueError: Its names are not this index's names (the missing and
                the unknown ones are named), or a tensor is not 0-dim.
        """
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"count", "gamma"}:
            keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise TypeError(f"state_dict must be a mapping with the keys 'count' and 'gamma', got {keys}")
        count, gamma = state_dict["count"], state_dict["gamma"]
        if not isinstance(gamma, Mapping):
            raise TypeError(f"state_dict['gamma'] must map parameter names to tensors, got {type(gamma).__name__}")
        missing = [n for n in self.index.names if n not in gamma]
        unknown = sorted(set(gamma) - set(self.index.names))
        if missing or unknown:
            raise ValueError(
                f"state_dict['gamma'] does not name this index's parameters: missing {missing}, unknown {unknown}"
            )
        for key, value in [("count", count), *((f"gamma[{n!r}]", gamma[n]) for n in self.index.names)]:
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"state_dict {key} must be a tensor, got {type(value).__name__}")
            if value.dim() != 0:
                raise ValueError(f"state_dict {key} must be a 0-dim tensor, got shape {tuple(value.shape)}")
        own = self._state
        new_gamma = torch.stack([gamma[n].detach().to(own.gamma) for n in self.index.names])
        copy_into_([own.count, own.gamma], [count.detach().to(own.count), new_gamma])

    def __repr__(self) -> str:
        return f"AdaGCStateful({self._state!r})"


def _copy_into(own: tuple[torch.Tensor, ...], new: Any, kind: type[tuple[Any, ...]], name: str) -> None:
    """Copies ``new``'s tensors into ``own``'s, in place, after checking that they match (host metadata only)."""
    if not isinstance(new, kind) or not all(
        isinstance(n, torch.Tensor) and n.shape == o.shape and n.dtype == o.dtype for n, o in zip(new, own)
    ):
        want = ", ".join(f"{tuple(o.shape)} {o.dtype}" for o in own)
        raise TypeError(
            f"state must be a {name} of tensors like the holder's ({want}): a step's stats.state, got {new!r}"
        )
    copy_into_(list(own), list(new))
