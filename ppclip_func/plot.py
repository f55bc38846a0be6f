"""A picture of a run's clip record: per-parameter gradient norms with the clip's decisions marked.

Reads the JSON Lines file a run's recorder wrote (one object per step) and
draws two panels over a shared step axis:

* top: the global gradient norm before clipping and the threshold it was
  clipped to (log scale), clipped steps as orange triangles, a non-finite
  total as a red cross at the top edge;
* bottom: a heatmap of every parameter's gradient norm (color: log10 of
  the norm; NaN/inf in magenta, exactly 0 in black), one row per parameter
  in the file's order with thin lines between layers, and a red box on each
  parameter a clipped or skipped step attributed its spike to.

Skipped steps are red bands across both panels. Below the heatmap, a note
per annotated step names its attributed parameters (the first 3, for at most
10 steps: every skipped one first, then those whose top attribution has the
largest z-score). A record without per-parameter norms (``"param_norms":
null``) gets the top panel only.

It is also a command::

    python -m ppclip_func.plot RECORD.jsonl [-o OUT.png] [--title T] [--max-params N]

matplotlib is an optional dependency (``pip install matplotlib``), imported
only when a picture is drawn; the figure is rendered with the Agg canvas
(no display, no pyplot state).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["plot_record", "read_jsonl"]

# Keep the picture readable: names per annotated step, annotated steps per picture.
_NAMES_PER_STEP = 3
_ANNOTATED_STEPS = 10
_NONFINITE_COLOR = "magenta"
_ZERO_COLOR = "black"
_ABSENT_COLOR = "0.85"
# The narrowest a skipped-step band or an attribution box is drawn, as a fraction of the step axis.
_MIN_MARK_WIDTH = 0.004
# Note lines wrap at this many characters (8 pt monospace across the 12 in figure).
_NOTE_WIDTH = 150


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads a JSON Lines file: one JSON object per non-blank line.

    ``NaN`` and ``Infinity`` (what Python's :mod:`json` writes for
    non-finite floats) read back as floats.

    Args:
        path: The file.

    Returns:
        The objects, in the file's order.

    Raises:
        ValueError: A line is not valid JSON or not a JSON object (the
            message names the file and line).

    Example:
        >>> import json, pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "record.jsonl"
        >>> _ = path.write_text(json.dumps({"step": 0, "total": float("nan")}) + "\\n\\n")
        >>> read_jsonl(path)
        [{'step': 0, 'total': nan}]
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {number}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}, line {number}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    return records


def plot_record(
    path_or_records: str | os.PathLike[str] | Sequence[dict[str, Any]],
    out_path: str | os.PathLike[str],
    *,
    title: str | None = None,
    max_params: int = 60,
) -> pathlib.Path:
    """Draws a run's clip record as a PNG: total norm and threshold above, per-parameter norms below.

    With more than ``max_params`` parameters, the heatmap keeps the
    parameters the eye should go to: first every parameter some step
    attributed its spike to (those with the largest attributed z-score
    first), then those whose norm strayed furthest from their own median
    over the run (the largest ``|log10(norm / median)|`` at any step; a
    non-finite norm counts as furthest). The rows kept stay in the file's
    order, and the axis label says how many of how many are shown.

    Steps are drawn in increasing order; a step recorded twice (a run
    resumed from a checkpoint) is drawn from its last record.

    Args:
        path_or_records: A JSON Lines file written by the recorder, or its
            records (dicts with ``step``, ``total``, ``threshold``,
            ``clipped``, ``skipped``, ``param_norms`` and ``spiked``;
            ``zscore`` and ``clip_coef`` are optional here).
        out_path: Where the PNG goes (its folder must exist).
        title: The figure's title; default: the file's name, or
            ``"gradient norms"`` for records passed in.
        max_params: The most heatmap rows.

    Returns:
        ``out_path``, as a path.

    Raises:
        ValueError: No records, a record without ``step``, or
            ``max_params < 1``.
        ImportError: matplotlib is not installed.

    Example:
        >>> import pytest; _ = pytest.importorskip("matplotlib")
        >>> import pathlib, tempfile
        >>> records = [
        ...     {"step": s, "total": 0.5 + s, "threshold": 2.0, "clipped": s > 1, "skipped": False,
        ...      "param_norms": {"layers.0.w": 0.4 + s, "layers.1.w": 0.3},
        ...      "spiked": [{"name": "layers.0.w", "zscore": 4.0, "norm": 0.4 + s}] if s > 1 else []}
        ...     for s in range(4)
        ... ]
        >>> plot_record(records, pathlib.Path(tempfile.mkdtemp()) / "clip.png").suffix
        '.png'
    """
    if isinstance(max_params, bool) or not isinstance(max_params, int) or max_params < 1:
        raise ValueError(f"max_params must be a positive integer, got {max_params!r}")
    if isinstance(path_or_records, (str, os.PathLike)):
        source = pathlib.Path(path_or_records)
        records = read_jsonl(source)
        where = str(source)
        default_title = source.name
    else:
        records = list(path_or_records)
        where = "the records passed"
        default_title = "gradient norms"
    if not records:
        raise ValueError(f"{where}: no records to plot (the file is empty)")
    for i, record in enumerate(records):
        if "step" not in record:
            raise ValueError(f"{where}: record {i} has no 'step'")
    # A run resumed from a checkpoint writes some steps again: the later line is the one that counted.
    latest = {record["step"]: record for record in records}
    records = [latest[step] for step in sorted(latest)]
    figure_cls, agg_canvas = _import_matplotlib()
    fig = _draw(records, figure_cls, title if title is not None else default_title, max_params)
    out = pathlib.Path(out_path)
    agg_canvas(fig)
    fig.savefig(out, dpi=120)
    return out


def _import_matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "ppclip_func.plot draws with matplotlib, which is not installed: pip install matplotlib"
        ) from e
    return Figure, FigureCanvasAgg


def _float(value: Any) -> float:
    """A record's number as a float; a missing one (None) is NaN."""
    return math.nan if value is None else float(value)


def _layer(name: str) -> str:
    """The group a parameter belongs to: its name up to the first numeric component (``layers.3``)."""
    match = re.match(r"^(.*?\.\d+)(\.|$)", name)
    return match.group(1) if match else name.split(".")[0]


def _param_names(records: list[dict[str, Any]]) -> list[str]:
    names: dict[str, None] = {}
    for record in records:
        for name in record.get("param_norms") or {}:
            names.setdefault(name)
    return list(names)


def _select(names: list[str], norms: Any, present: Any, records: list[dict[str, Any]], max_params: int) -> list[int]:
    """The rows to show (indices into ``names``, in order); see :func:`plot_record` for the rule."""
    import numpy as np

    if len(names) <= max_params:
        return list(range(len(names)))
    attributed: dict[str, float] = {}
    for record in records:
        for entry in record.get("spiked") or []:
            z = _float(entry.get("zscore"))
            z = math.inf if math.isnan(z) else z
            attributed[entry["name"]] = max(attributed.get(entry["name"], -math.inf), z)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log10(norms)
    finite = np.isfinite(logs)
    excursion = np.zeros(len(names))
    for row in range(len(names)):
        values = logs[row][finite[row]]
        if values.size:
            excursion[row] = np.max(np.abs(values - np.median(values)))
        if np.any(present[row] & ~np.isfinite(norms[row])):
            excursion[row] = math.inf  # a NaN/inf norm is as far off as a norm gets
    order = sorted(
        range(len(names)),
        key=lambda row: (names[row] not in attributed, -attributed.get(names[row], 0.0), -excursion[row]),
    )
    return sorted(order[:max_params])


def _annotated(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The anomalous steps to name (step order) and how many anomalous steps were left unnamed."""
    anomalous = [r for r in records if (r.get("clipped") or r.get("skipped")) and r.get("spiked")]

    def rank(record: dict[str, Any]) -> tuple[bool, float]:
        z = _float(record["spiked"][0].get("zscore"))
        return (not record.get("skipped"), -(math.inf if math.isnan(z) else z))

    chosen = sorted(anomalous, key=rank)[:_ANNOTATED_STEPS]
    return sorted(chosen, key=lambda r: r["step"]), len(anomalous) - len(chosen)


def _edges(steps: Any) -> Any:
    """Cell edges on the step axis: halfway between neighbours, half a gap beyond the ends."""
    import numpy as np

    if steps.size == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    mid = (steps[1:] + steps[:-1]) / 2
    return np.concatenate([[2 * steps[0] - mid[0]], mid, [2 * steps[-1] - mid[-1]]])


def _span(edges: Any, col: int) -> tuple[float, float]:
    """Column ``col``'s extent on the step axis, widened to a visible sliver when a run has thousands of steps."""
    left, right = float(edges[col]), float(edges[col + 1])
    grow = max(0.0, _MIN_MARK_WIDTH * float(edges[-1] - edges[0]) - (right - left)) / 2
    return left - grow, right + grow


def _draw(records: list[dict[str, Any]], figure_cls: Any, title: str, max_params: int) -> Any:
    import numpy as np

    steps = np.array([float(r["step"]) for r in records])
    edges = _edges(steps)
    total = np.array([_float(r.get("total")) for r in records])
    threshold = np.array([_float(r.get("threshold")) for r in records])
    clipped = np.array([bool(r.get("clipped")) for r in records])
    skipped = np.array([bool(r.get("skipped")) for r in records])

    names = _param_names(records)
    notes, unnamed = _annotated(records)
    note_lines = _note_lines(notes, unnamed)
    heat = bool(names)
    if heat:
        norms = np.full((len(names), len(records)), np.nan)
        present = np.zeros_like(norms, dtype=bool)
        row_of = {name: i for i, name in enumerate(names)}
        for col, record in enumerate(records):
            for name, value in (record.get("param_norms") or {}).items():
                norms[row_of[name], col] = _float(value)
                present[row_of[name], col] = True
        shown = _select(names, norms, present, records, max_params)
        names_shown = [names[i] for i in shown]
        norms, present = norms[shown], present[shown]

    heat_h = max(2.5, 0.16 * len(names_shown)) if heat else 0.0
    note_h = 0.14 * len(note_lines) + 0.15 if note_lines else 0.0
    top_h = 2.6
    fig = figure_cls(figsize=(12, top_h + heat_h + note_h + 0.9), layout="constrained")
    rows = [top_h] + ([heat_h] if heat else []) + ([note_h] if note_lines else [])
    grid = fig.add_gridspec(len(rows), 2, height_ratios=rows, width_ratios=[60, 1])
    top = fig.add_subplot(grid[0, 0])
    fig.suptitle(title)

    handles = _top_panel(top, steps, total, threshold, clipped, skipped)

    panels = [top]
    if heat:
        ax = fig.add_subplot(grid[1, 0], sharex=top)
        panels.append(ax)
        columns = [int(np.searchsorted(steps, float(r["step"]))) for r in notes]
        handles += _heatmap(
            fig, ax, fig.add_subplot(grid[1, 1]), edges, norms, present, names_shown, len(names), notes, columns
        )
        top.tick_params(labelbottom=False)
    else:
        top.set_xlabel("step")
    for ax in panels:
        for skipped_col in np.flatnonzero(skipped).tolist():
            ax.axvspan(*_span(edges, skipped_col), color="red", alpha=0.25, lw=0, zorder=3)
    top.set_xlim(edges[0], edges[-1])
    top.margins(y=0.12)
    top.legend(
        handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=min(len(handles), 4), fontsize=8,
        frameon=False,
    )  # fmt: skip

    if note_lines:
        ax = fig.add_subplot(grid[len(rows) - 1, :])
        ax.axis("off")
        note = ax.text(0.0, 1.0, "\n".join(note_lines), va="top", ha="left", family="monospace", fontsize=8,
                       transform=ax.transAxes)  # fmt: skip
        note.set_in_layout(False)  # sized by its line count above; its width must not squeeze the panels
    return fig


def _top_panel(top: Any, steps: Any, total: Any, threshold: Any, clipped: Any, skipped: Any) -> list[Any]:
    """The total and the threshold on a log scale, clipped steps and non-finite totals marked.

    Non-positive and non-finite values leave gaps in the lines. Returns the legend entries.
    """
    import numpy as np
    from matplotlib.patches import Patch
    from matplotlib.transforms import blended_transform_factory

    finite_total = np.where(np.isfinite(total) & (total > 0), total, np.nan)
    finite_threshold = np.where(np.isfinite(threshold) & (threshold > 0), threshold, np.nan)
    top.plot(steps, finite_total, color="tab:blue", lw=1.2, marker=".", ms=3, label="total norm (before clip)")
    if np.any(np.isfinite(finite_threshold)):
        top.plot(steps, finite_threshold, color="0.2", lw=1.0, ls="--", label="threshold")
    if np.any(clipped & np.isfinite(finite_total)):
        top.plot(
            steps[clipped], finite_total[clipped], ls="none", marker="v", ms=8, color="tab:orange", label="clipped"
        )
    bad = ~np.isfinite(total)
    if np.any(bad):
        at_top = blended_transform_factory(top.transData, top.transAxes)
        top.plot(
            steps[bad], np.full(bad.sum(), 0.96), ls="none", marker="X", ms=8, color="red",
            transform=at_top, label="total NaN/inf",
        )  # fmt: skip
    if np.any(np.isfinite(finite_total)) or np.any(np.isfinite(finite_threshold)):
        top.set_yscale("log")
    top.set_ylabel("gradient norm")
    top.grid(True, which="major", alpha=0.3)
    handles, _ = top.get_legend_handles_labels()
    if np.any(skipped):
        handles.append(Patch(color="red", alpha=0.25, lw=0, label="skipped step"))
    return handles


def _heatmap(
    fig: Any,
    ax: Any,
    cax: Any,
    edges: Any,
    norms: Any,
    present: Any,
    names: list[str],
    n_names: int,
    notes: list[dict[str, Any]],
    columns: list[int],
) -> list[Any]:
    """The per-parameter panel: log10 norms, layer separators, a colorbar, boxes on attributed cells.

    Returns the legend entries for what the panel marks.
    """
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import Normalize
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.log10(norms)
    finite = np.isfinite(logs)
    low, high = (float(logs[finite].min()), float(logs[finite].max())) if finite.any() else (0.0, 1.0)
    if high - low < 1e-6:
        low, high = low - 0.5, high + 0.5
    zero = present & (norms == 0)
    nonfinite = present & ~np.isfinite(norms)
    # Colors outside the scale mark what is not a norm to color: over = NaN/inf, under = exactly 0.
    values = np.where(finite, logs, np.nan)
    values[nonfinite] = high + 1.0
    values[zero] = low - 1.0
    cmap = colormaps["viridis"].with_extremes(over=_NONFINITE_COLOR, under=_ZERO_COLOR, bad=_ABSENT_COLOR)
    rows_edges = np.arange(len(names) + 1) - 0.5
    mesh = ax.pcolormesh(
        edges, rows_edges, np.ma.masked_invalid(values), cmap=cmap, norm=Normalize(low, high), rasterized=True
    )
    ax.set_ylim(len(names) - 0.5, -0.5)  # the file's first parameter on top
    ax.set_yticks(range(len(names)), names, fontsize=7 if len(names) <= 40 else 6)
    ax.set_xlabel("step")
    shown = f"{len(names)} of {n_names} parameters" if len(names) < n_names else f"{n_names} parameters"
    ax.set_ylabel(shown)
    groups = [_layer(name) for name in names]
    for row in range(1, len(names)):
        if groups[row] != groups[row - 1]:
            ax.axhline(row - 0.5, color="white", lw=0.8)
    colorbar = fig.colorbar(mesh, cax=cax, extend="neither")
    colorbar.set_label("log10 grad norm", fontsize=8)

    row_of = {name: i for i, name in enumerate(names)}
    boxes = 0
    for record, col in zip(notes, columns):
        for entry in record["spiked"][:_NAMES_PER_STEP]:
            shown_row = row_of.get(entry["name"])
            if shown_row is None:
                continue  # not among the rows shown; the note below still names it
            boxes += 1
            left, right = _span(edges, col)
            ax.add_patch(Rectangle((left, shown_row - 0.5), right - left, 1.0, fill=False, ec="red", lw=1.6, zorder=4))
    handles: list[Any] = []  # the legend's: a Line2D and Patches
    if boxes:
        handles.append(
            Line2D([], [], ls="none", marker="s", ms=9, mfc="none", mec="red", mew=1.6, label="attributed parameter")
        )
    if nonfinite.any():
        handles.append(Patch(color=_NONFINITE_COLOR, label="param norm NaN/inf"))
    if zero.any():
        handles.append(Patch(color=_ZERO_COLOR, label="param norm 0"))
    if (~present).any():
        handles.append(Patch(color=_ABSENT_COLOR, label="not recorded"))
    return handles


def _note_lines(notes: list[dict[str, Any]], unnamed: int) -> list[str]:
    """The text below the heatmap: one line per annotated step, its first attributed parameters."""
    lines = []
    width = max((len(str(r["step"])) for r in notes), default=0)
    for record in notes:
        what = "skipped" if record.get("skipped") else "clipped"
        items = [
            f"{e['name']} (z {_float(e.get('zscore')):.3g}, norm {_float(e.get('norm')):.3g})"
            for e in record["spiked"][:_NAMES_PER_STEP]
        ]
        more = len(record["spiked"]) - _NAMES_PER_STEP
        if more > 0:
            items.append(f"+{more} more")
        # Wrapped between parameters, never inside one's name or numbers.
        line = f"step {record['step']:>{width}} {what}: "
        indent, fresh = " " * len(line), True
        for i, item in enumerate(items):
            item += "," if i < len(items) - 1 else ""
            if not fresh and len(line) + 1 + len(item) > _NOTE_WIDTH:
                lines.append(line)
                line, fresh = indent, True
            line += item if fresh else " " + item
            fresh = False
        lines.append(line)
    if unnamed:
        lines.append(f"... {unnamed} more clipped/skipped steps with attributions (not named here)")
    if lines:
        lines.insert(0, "attributed parameters (largest z-score first):")
    return lines


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ppclip_func.plot",
        description="Draws a clip record (JSON Lines, one object per step) as a PNG: total norm and threshold, "
        "per-parameter norms as a heatmap, clipped and skipped steps marked.",
    )
    parser.add_argument("record", type=pathlib.Path, help="the JSON Lines file the run wrote")
    parser.add_argument("-o", "--out", type=pathlib.Path, default=None, help="the PNG (default: RECORD with .png)")
    parser.add_argument("--title", default=None, help="the figure's title (default: the file's name)")
    parser.add_argument("--max-params", type=int, default=60, help="the most heatmap rows (default 60)")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else args.record.with_suffix(".png")
    try:
        written = plot_record(args.record, out, title=args.title, max_params=args.max_params)
    except (OSError, ValueError, ImportError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
