"""The spike demonstration (``make demo-spike``) runs on 8 ranks and does what its table says.

A short run of ``python -m demo.spike`` (12 steps, warm-up 4, the spike at
step 8). Read back from its output: the spike is clipped to the fixed and
to the adaptive threshold, only the skipping run skips it, and the three
runs agree exactly through the warm-up (same seed, same data, all clipped at
max_norm), and the skipping run is the adaptive one until the spike.
"""

from __future__ import annotations

import re
import sys

import pytest

from tests._processes import python, run_bounded

TIMEOUT_S = 240
SPIKE = 8

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="tests/_processes.py reads /proc")


@pytest.fixture(scope="module")
def output() -> str:
    cmd = [python(), "-m", "demo.spike", "--steps", "12", "--warmup", "4", "--spike-step", str(SPIKE)]
    code, out, leftovers = run_bounded(cmd, TIMEOUT_S, env={"OMP_NUM_THREADS": "1"})
    assert not leftovers, f"processes left behind: {leftovers}"
    assert code == 0, f"the spike demo exited with {code}:\n{out[-6000:]}"
    return out


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
