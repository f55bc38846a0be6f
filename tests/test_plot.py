"""``ppclip_func.plot`` draws a clip record (JSON Lines) as a readable PNG, from Python and as a command.

The record is synthetic and small: 30 steps, 12 parameters, one parameter
spiking x50 at step 20 (clipped there and attributed to it), one skipped
step with a NaN total at step 25. The pictures are checked for being real
images with something on them; what they look like was checked by eye.
The tests that draw skip when matplotlib is not installed.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

from ppclip_func.plot import plot_record, read_jsonl


@pytest.fixture
def matplotlib():
    """The tests that draw need matplotlib, an optional dependency; the others run without it."""
    return pytest.importorskip("matplotlib", reason="ppclip_func.plot draws with matplotlib (pip install matplotlib)")


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SPIKE_STEP, SKIP_STEP = 20, 25
SPIKED = "layers.2.mlp.w1.weight"


def _names() -> list[str]:
    names = ["tok_embeddings.weight"]
    for i in range(4):
        names += [f"layers.{i}.attn.wq.weight", f"layers.{i}.mlp.w1.weight"]
    return [*names, "layers.4.attn.wq.weight", "norm.weight", "output.weight"]


def _records(param_norms: bool = True) -> list[dict]:
    names = _names()
    assert len(names) == 12
    records = []
    for step in range(30):
        norms = {name: 0.1 * (1 + i) * (1 + 0.05 * math.sin(step + i)) for i, name in enumerate(names)}
        spiked: list[dict] = []
        if step == SPIKE_STEP:
            norms[SPIKED] *= 50
            spiked = [
                {"name": SPIKED, "zscore": 40.0, "norm": norms[SPIKED]},
                {"name": "layers.2.attn.wq.weight", "zscore": 2.1, "norm": norms["layers.2.attn.wq.weight"]},
            ]
        if step == SKIP_STEP:
            norms["layers.1.attn.wq.weight"] = math.nan
            spiked = [{"name": "layers.1.attn.wq.weight", "zscore": math.nan, "norm": math.nan}]
        total = math.nan if step == SKIP_STEP else math.sqrt(sum(v * v for v in norms.values()))
        threshold = math.inf if step < 5 else 1.0
        clipped = step == SPIKE_STEP
        records.append(
            {
                "step": step,
                "total": total,
                "threshold": threshold,
                "zscore": math.nan if step < 5 else (30.0 if clipped else 0.3),
                "clip_coef": min(1.0, threshold / total) if math.isfinite(total) else math.nan,
                "clipped": clipped,
                "skipped": step == SKIP_STEP,
                "param_norms": norms if param_norms else None,
                "spiked": spiked,
            }
        )
    return records


def _write(path: pathlib.Path, records: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _assert_real_picture(path: pathlib.Path) -> None:
    import matplotlib.image

    assert path.is_file(), f"{path} was not written"
    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert path.stat().st_size > 20_000, f"{path} is only {path.stat().st_size} bytes"
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 600, pixels.shape
    assert pixels.std() > 0.05, f"{path} is nearly one color (pixel std {pixels.std():.3f})"


def test_read_jsonl_round_trips_nonfinite_values(tmp_path):
    records = _records()
    back = read_jsonl(_write(tmp_path / "record.jsonl", records))
    assert [r["step"] for r in back] == list(range(30))
    assert math.isnan(back[SKIP_STEP]["total"]) and back[0]["threshold"] == math.inf
    assert back[SPIKE_STEP]["spiked"][0]["name"] == SPIKED


def test_command_writes_the_picture(tmp_path, matplotlib):
    record = _write(tmp_path / "record.jsonl", _records())
    out = tmp_path / "picture.png"
    done = subprocess.run(
        [sys.executable, "-m", "ppclip_func.plot", str(record), "-o", str(out), "--title", "synthetic run"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    _assert_real_picture(out)


def test_command_defaults_to_the_record_name(tmp_path, matplotlib):
    record = _write(tmp_path / "run.jsonl", _records())
    done = subprocess.run(
        [sys.executable, "-m", "ppclip_func.plot", str(record)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    _assert_real_picture(tmp_path / "run.png")


def test_plot_record_from_a_file_and_from_records(tmp_path, matplotlib):
    records = _records()
    from_file = plot_record(_write(tmp_path / "record.jsonl", records), tmp_path / "a.png")
    from_records = plot_record(records, tmp_path / "b.png", title="records")
    assert from_file == tmp_path / "a.png" and from_records == tmp_path / "b.png"
    _assert_real_picture(from_file)
    _assert_real_picture(from_records)


def test_more_parameters_than_max_params(tmp_path, matplotlib):
    out = plot_record(_records(), tmp_path / "few.png", max_params=4)
    _assert_real_picture(out)


def test_without_param_norms_draws_the_top_panel(tmp_path, matplotlib):
    out = plot_record(_write(tmp_path / "record.jsonl", _records(param_norms=False)), tmp_path / "top.png")
    _assert_real_picture(out)


def test_empty_file_is_a_clear_error(tmp_path):
    record = tmp_path / "empty.jsonl"
    record.write_text("")
    with pytest.raises(ValueError, match="no records"):
        plot_record(record, tmp_path / "never.png")
    done = subprocess.run(
        [sys.executable, "-m", "ppclip_func.plot", str(record)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "no records" in done.stderr and "empty.jsonl" in done.stderr
    assert not (tmp_path / "empty.png").exists()


def test_bad_line_names_the_line(tmp_path):
    record = tmp_path / "bad.jsonl"
    record.write_text(json.dumps(_records()[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2"):
        read_jsonl(record)


def test_bad_max_params(tmp_path):
    with pytest.raises(ValueError, match="max_params"):
        plot_record(_records(), tmp_path / "never.png", max_params=0)


def test_missing_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_record(_records(), tmp_path / "never.png")
