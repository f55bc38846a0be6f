"""Options a trainer integration takes for a clip, checked where they are given, not at the first step.

An integration (OLMo-core, Lightning, Accelerate, transformers) is configured
once, long before its first clip: by a call that patches a trainer, a class
attribute, a constructor argument. A misspelled key or an out-of-range value
found at the first ``optim_step`` costs a built, sharded model and a first
batch; found here it costs nothing. :func:`check_options` is the one check
they all use: the option names are read from the public form's own
signature, and the values go through the same static checks the form runs
on every call, so the two can never disagree.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

from .._clip.adaptive import Rule, check_adaptive_args, init_clip_state
from .._core.excluded import check_exclude
from .._core.norms import norm_kind
from .._core.setup import NormOptions, check_clip_args, check_norm_options

__all__ = ["check_options"]

# The arguments of a public form that carry the model or its state, never an option.
_INPUTS = frozenset({"parameters", "grads", "mesh", "state"})


def check_options(
    form: Callable[..., Any],
    options: Mapping[str, Any] | None,
    *,
    where: str,
    fixed: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Returns ``options`` as a new dict once they are known to be valid keyword arguments of ``form``.

    Args:
        form: The public function the options are for:
            :func:`ppclip_func.clip_grad_norm_` or
            :func:`ppclip_func.adaptive_clip_grad_norm_`.
        options: Keyword arguments of ``form`` (``None``: none).
        where: The integration and argument they were given to, as the
            user wrote it (``"use_ppclip(adaptive=...)"``), named in every error.
        fixed: ``{option: what sets it}`` for options the integration passes
            itself (``{"max_norm": "the train module's max_grad_norm"}``):
            giving one of them again is an error.

    Returns:
        A copy of ``options``.

    Raises:
        TypeError: ``options`` is not a mapping of names, a name is not an
            option of ``form`` (the closest ones are suggested), an option
            is one the integration sets itself, or a value has the wrong type.
        ValueError: A value is out of range or names no known rule.

    Example:
        >>> from ppclip_func import adaptive_clip_grad_norm_
        >>> from ppclip_func._trainers.options import check_options
        >>> check_options(adaptive_clip_grad_norm_, {"z": 3.0}, where="example")
        {'z': 3.0}
        >>> check_options(adaptive_clip_grad_norm_, {"zscore_epss": 1.0}, where="example")
        Traceback (most recent call last):
        ...
        TypeError: example: 'zscore_epss' is not an option of adaptive_clip_grad_norm_ (did you mean 'zscore_eps'?)
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"{where}: options must be a mapping of option names to values, got {type(options).__name__}")
    check = _STATIC_CHECKS.get(form.__name__)
    if check is None:
        raise TypeError(f"{where}: no options are checked for {form.__name__}")
    fixed = fixed or {}
    names = _option_names(form)
    for name in options:
        if not isinstance(name, str):
            raise TypeError(f"{where}: option names must be strings, got {name!r}")
        if name in fixed:
            raise TypeError(f"{where}: {name!r} is set by {fixed[name]}; leave it out of the options")
        if name not in names:
            close = difflib.get_close_matches(name, sorted(names), n=2)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else f"; its options: {sorted(names)}"
            raise TypeError(f"{where}: {name!r} is not an option of {form.__name__}{hint}")
    values = {**_defaults(form), **options}
    try:
        check(values)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}: {error}") from None
    return dict(options)


def _option_names(form: Callable[..., Any]) -> frozenset[str]:
    return frozenset(name for name in inspect.signature(form).parameters if name not in _INPUTS)


def _defaults(form: Callable[..., Any]) -> dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(form).parameters.items()
        if name not in _INPUTS and p.default is not inspect.Parameter.empty
    }


def _layout_options(values: Mapping[str, Any]) -> NormOptions:
    return NormOptions(
        values.get("pp_dim"),
        values.get("groups"),
        values.get("tied"),
        values.get("partial", "error"),
        values.get("overflow_safe", False),
        values.get("param_norms"),
        values.get("pp_mesh"),
    )


def _check_clip(values: Mapping[str, Any]) -> None:
    """The static checks of :func:`ppclip_func.clip_grad_norm_`."""
    norm_kind(values["norm_type"])
    check_clip_args(values.get("max_norm", 1.0), values["eps"], values["nonfinite"])
    check_norm_options(_layout_options(values))


def _check_adaptive(values: Mapping[str, Any]) -> None:
    """The static checks of :func:`ppclip_func.adaptive_clip_grad_norm_`."""
    rule = Rule(*(values[name] for name in Rule._fields))
    norm_kind(values["norm_type"])
    check_clip_args(math.inf if rule.max_norm is None else rule.max_norm, values["eps"], values["nonfinite"])
    check_adaptive_args(init_clip_state(), rule)
    check_exclude(values["groups"], values["exclude"])
    check_norm_options(_layout_options(values))


_STATIC_CHECKS: dict[str, Callable[[Mapping[str, Any]], None]] = {
    "clip_grad_norm_": _check_clip,
    "adaptive_clip_grad_norm_": _check_adaptive,
}
