"""The spike demonstration (``make demo-spike``) runs on 8 ranks and does what its table says.

A short run of ``python -m demo.spike`` (12 steps, warm-up 4, the spike at
step 8). Read back from its output: the spike is clipped to the fixed and
to the adaptive threshold, only the skipping run skips it, and the three
runs agree exactly through the warm-up (same seed, same data, all clipped at
max_norm), and the skipping run is the adaptive one until the spike.

The two adaptive runs record every step on the device (``ClipRecorder``, read
one step later, on the PP × FSDP2 × TP layout): each record must equal the
values the demo read on the host right after the same step, the spike must
be the only anomalous step of the adaptive run and name parameters, and the
heatmap drawn from the record must be a real picture.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import pytest

from tests._processes import WHOLE_COMMANDS, python, run_bounded

TIMEOUT_S = 240
SPIKE = 8

pytestmark = WHOLE_COMMANDS  # each test runs a whole command


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("spike-record")


@pytest.fixture(scope="module")
def output(record_dir: pathlib.Path) -> str:
    cmd = [python(), "-m", "demo.spike", "--steps", "12", "--warmup", "4", "--spike-step", str(SPIKE)]
    cmd += ["--record-dir", str(record_dir)]
    code, out, leftovers = run_bounded(cmd, TIMEOUT_S, env={"OMP_NUM_THREADS": "1"})
    assert not leftovers, f"processes left behind: {leftovers}"
    assert code == 0, f"the spike demo exited with {code}:\n{out[-6000:]}"
    return out


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("run", ["adaptive", "skip"])
def test_the_record_equals_the_values_read_on_the_host_after_each_step(output, record_dir, run):
    records = [json.loads(line) for line in (record_dir / f"{run}.jsonl").read_text().splitlines()]
    host = json.loads((record_dir / f"{run}.host.json").read_text())
    assert [r["step"] for r in records] == list(range(1, 13))
    for r, h in zip(records, host):
        assert _same(r["total"], h["norm"]) and _same(r["threshold"], h["threshold"]), (r["step"], r, h)
        assert _same(r["zscore"], h["zscore"]) and r["skipped"] == h["skip"], r["step"]
        assert list(r["param_norms"]) == list(h["param_norms"])  # every parameter of every stage, in order
        assert all(_same(r["param_norms"][n], v) for n, v in h["param_norms"].items()), r["step"]


def test_the_recorder_names_parameters_at_the_spike_only(output, record_dir):
    records = [json.loads(line) for line in (record_dir / "adaptive.jsonl").read_text().splitlines()]
    spike = records[SPIKE - 1]
    assert spike["step"] == SPIKE and spike["clipped"] and len(spike["spiked"]) == 3, spike["spiked"]
    assert all(s["name"] in spike["param_norms"] for s in spike["spiked"]), spike["spiked"]
    # Named only on clipped or skipped steps; the spike's parameters are far beyond any other step's.
    assert all(bool(r["spiked"]) <= (r["clipped"] or r["skipped"]) for r in records)
    elsewhere = [s["zscore"] for r in records if r["step"] != SPIKE for s in r["spiked"]]
    assert min(s["zscore"] for s in spike["spiked"]) > 100 * max(elsewhere, default=1.0), (spike["spiked"], elsewhere)
    assert re.search(rf"step {SPIKE}: norm [\d.]+, clipped to [\d.]+; named: \S+ \(z ", output), output[-3000:]


def test_the_heatmap_is_drawn_from_the_record(output, record_dir):
    picture = record_dir / "adaptive.png"
    assert picture.exists(), output[-3000:]
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert picture.stat().st_size > 20_000
    pixels = pytest.importorskip("matplotlib.image").imread(picture)
    assert float(pixels.std()) > 0.05, "a picture, not a blank"


def _rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if re.match(r"^ +\d+ +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ ", line)]


def test_the_spike_is_clipped_or_skipped_and_the_runs_agree_before_it(output: str):
    rows = _rows(output)
    assert [int(r[0]) for r in rows] == list(range(1, 13)), output
    norm = float(rows[SPIKE - 1][1])
    assert norm > 100 * float(rows[SPIKE - 2][1]), "the spiked step's norm is about 1000 times the others"
    for r in rows[:5]:  # the losses of the warm-up steps (4) and the one after: every run clipped at max_norm
        assert r[2] == r[3] == r[4] == r[5], f"the runs differ in warm-up: {r}"
    for r in rows[:SPIKE]:  # the skipping run is the adaptive one until it skips
        assert r[3] == r[4], f"adaptive and skipping runs differ before the spike: {r}"
    skipped = [int(r[0]) for r in rows if "yes" in r]
    assert skipped == [SPIKE], skipped
    assert re.search(r"skip: spike at step 8: norm [\d.]+, threshold", output)
    assert float(rows[SPIKE - 1][8]) < 0.01, "AdaGC clipped the spiked parameters to their own history"
    assert re.search(r"adagc: spike at step 8: norm [\d.]+, smallest coefficient", output)
    assert "per-parameter norms (all 21 parameters, every stage, on every rank)" in output
