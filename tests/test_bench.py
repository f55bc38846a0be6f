"""``python -m bench --quick`` runs every study end to end and writes well-formed results.

The quick run's timings say nothing (tiny sizes, a shared CI machine, and
``aot_eager`` in place of inductor), so the numbers are checked for
presence and sign only; what the results must say regardless of speed is
checked exactly: one collective per clip for ours, more for the
torchtitan baseline, both computing the same 2-norm, and ours matching
the float64 reference for every norm type.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib

import pytest

from bench import _allocator
from tests._processes import WHOLE_COMMANDS, python, run_bounded

TIMEOUT_S = 420
STUDIES = ("bandwidth", "leaves", "distributed", "ranks", "features", "optimizer")

pytestmark = WHOLE_COMMANDS  # each test runs a whole command


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("bench")
    code, log, leftovers = run_bounded([python(), "-m", "bench", "--quick", "--out", str(out)], TIMEOUT_S)
    assert not leftovers, f"processes left behind: {leftovers}"
    assert code is not None, f"bench --quick did not finish within {TIMEOUT_S} s:\n{log[-4000:]}"
    assert code == 0, f"bench --quick exited with {code}:\n{log[-6000:]}"
    return out


def _load(results: pathlib.Path, name: str) -> dict:
    data = json.loads((results / f"{name}.json").read_text())
    assert data["study"] == name
    return data


def _run_study(module: str, out: pathlib.Path, timeout: float, *flags: str) -> None:
    """Runs ``python -m bench.<module> --quick FLAGS --out OUT`` with a hard timeout; it must leave nothing behind."""
    cmd = [python(), "-m", f"bench.{module}", "--quick", *flags, "--out", str(out)]
    code, log, leftovers = run_bounded(cmd, timeout)
    assert not leftovers, f"processes left behind: {leftovers}"
    assert code == 0, f"{module} {' '.join(flags)} exited with {code}:\n{log[-4000:]}"


def _positive_numbers(d: dict, where: str, *fields: str) -> None:
    """Every value of ``d`` (or of each of its ``fields``, each a dict) is a finite number > 0."""
    if fields:
        for field in fields:
            _positive_numbers(d[field], f"{where} {field}")
        return
    assert d, f"{where} is empty"
    for k, v in d.items():
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, f"{where}[{k!r}] = {v!r}"


def test_every_study_writes_json_and_a_plot(results: pathlib.Path):
    for name in STUDIES:
        data = _load(results, name)
        assert data["quick"] is True
        assert data["runs"] >= 5
        assert data["machine"]["torch"]
        if importlib.util.find_spec("matplotlib") is not None:
            assert (results / f"{name}.png").stat().st_size > 1000
    assert _load(results, "gpu")["measured"] is False


def test_bandwidth_schema(results: pathlib.Path):
    data = _load(results, "bandwidth")
    assert data["model"]["leaves"] > 0 and data["model"]["params"] > 0
    assert not data["errors"], data["errors"]
    assert set(data["dtypes"]) == {"float32", "bfloat16"}
    for dtype, d in data["dtypes"].items():
        assert set(d["ms"]) == {
            "bound_inplace",
            "bound_pure",
            "torch_eager",
            "torch_compiled",
            "ours_eager_inplace",
            "ours_eager_pure",
            "ours_compiled_inplace",
            "ours_compiled_pure",
        }
        _positive_numbers(d, dtype, "ms", "fraction_of_bound", "bound_GBps")
        assert set(d["fraction_of_bound"]) == set(d["ms"]) - {"bound_inplace", "bound_pure"}
    # The pure variants again under every C allocator setting, each in a process of its own.
    assert data["allocator"] in _allocator.ALLOCATORS
    assert set(data["allocators"]) == set(_allocator.ALLOCATORS)
    for name, a in data["allocators"].items():
        if "skipped" in a:
            assert name == "jemalloc" and _allocator.find_jemalloc() is None, (name, a)
            continue
        assert not a["errors"], (name, a["errors"])
        for dtype, d in a["dtypes"].items():
            assert set(d["ms"]) == {"bound_pure", "ours_eager_pure", "ours_compiled_pure"}
            _positive_numbers(d["fraction_of_bound"], f"{name} {dtype} fraction_of_bound")


@pytest.mark.skipif(
    _allocator.find_jemalloc() is None, reason="libjemalloc is not installed (`make bench` installs libjemalloc2)"
)
def test_bandwidth_study_reexecutes_itself_under_jemalloc(tmp_path: pathlib.Path):
    _run_study("bandwidth_study", tmp_path, 180, "--allocator", "jemalloc", "--pure-only")
    data = json.loads((tmp_path / "bandwidth-jemalloc.json").read_text())
    assert data["study"] == "bandwidth"
    # read in the child from /proc/self/maps: jemalloc was loaded, not just asked for
    assert data["allocator"] == "jemalloc"
    assert not data["errors"], data["errors"]
    for dtype, d in data["dtypes"].items():
        assert set(d["ms"]) == {"bound_pure", "ours_eager_pure", "ours_compiled_pure"}
        _positive_numbers(d["fraction_of_bound"], f"{dtype} fraction_of_bound")


def test_leaves_schema(results: pathlib.Path):
    data = _load(results, "leaves")
    for series in ("fixed_total", "fixed_leaf"):
        points = data["series"][series]
        assert [p["leaves"] for p in points] == data["config"]["counts"]
        for p in points:
            assert "errors" not in p, p["errors"]
            assert set(p["ms"]) == {
                "torch_eager",
                "ours_eager",
                "torch_compiled",
                "ours_compiled",
                "torch_dtensor_eager",
                "ours_dtensor_eager",
            }
            _positive_numbers(p, f"{series} {p['leaves']}", "ms", "ratio_torch_over_ours", "compile_s", "first_call_ms")


def test_distributed_counts_one_collective_for_ours(results: pathlib.Path):
    data = _load(results, "distributed")
    # torchtitan's own clip where it is installed (the bench extra), else the same algorithm written here.
    assert data["baseline"].startswith(("torchtitan 0.3.0", "written here")), data["baseline"]
    assert {(w["world"], w["case"]) for w in data["worlds"]} == {(4, "dense"), (4, "ep")}
    for w in data["worlds"]:
        assert "errors" not in w, w["errors"]
        assert set(w["ms"]) == {"ours_eager", "baseline_eager", "ours_compiled", "baseline_compiled"}
        _positive_numbers(w["ms"], f"{w['world']} ranks ms")
        _positive_numbers(w["speedup_ours_over_baseline"], f"{w['world']} ranks speed-up")
        counts = w["collectives_per_clip"]
        assert counts["ours_eager"] == counts["ours_compiled"] == 1, counts
        # get_total_norm(...).full_tensor() reduces over each sharded dim (per mesh family with EP),
        # then one more over pp.
        assert counts["baseline_eager"] >= 2 and counts["baseline_compiled"] >= 2, counts
        if w["case"] == "ep":
            assert counts["baseline_eager"] >= 3, counts
        assert w["norm_max_rel_diff_ours_vs_baseline"] < 1e-5


def test_distributed_checks_every_norm_type_against_float64(results: pathlib.Path):
    data = _load(results, "distributed")
    for w in data["worlds"]:
        norms = w["norm_types"]
        assert set(norms) == {"2.0", "1.0", "inf", "-inf", "0.0"}
        for nt, e in norms.items():
            assert e["ours_rel_err"] < 1e-5, (w["case"], nt, e)
            assert ("baseline" in e) != ("baseline_error" in e), (w["case"], nt, e)


def test_ranks_schema(results: pathlib.Path):
    data = _load(results, "ranks")
    points = data["points"]
    assert [p["world"] for p in points] == data["config"]["worlds"]
    for p in points:
        assert p["mesh"]["pp"] * p["mesh"]["dp"] * p["mesh"]["tp"] == p["world"]
        assert set(p["ms"]) == {"ours_eager", "torch_eager"}
        _positive_numbers(p["ms"], f"{p['world']} ranks ms")
        _positive_numbers(p["first_call_ms"], f"{p['world']} ranks first_call_ms")
        _positive_numbers(p["growth_vs_smallest"], f"{p['world']} ranks growth")
        assert p["mesh_create_ms"] > 0
    assert points[0]["growth_vs_smallest"] == {"ours_eager": 1.0, "torch_eager": 1.0}


def test_features_schema(results: pathlib.Path):
    data = _load(results, "features")
    settings = {s["setting"]: s for s in data["settings"]}
    assert set(settings) == {"gpt2", "100_leaves"}
    for name, s in settings.items():
        assert set(s["eager_ms"]) == {"plain", "adaptive", "adaptive_skip", "param_norms"}
        _positive_numbers(s["eager_ms"], f"{name} eager_ms")
        _positive_numbers(s["eager_ratio_vs_plain"], f"{name} eager ratios")
        _positive_numbers(s["optimizer_ms"], f"{name} optimizer_ms")
        assert s["skippable_over_adamw"] > 0
    _positive_numbers(settings["gpt2"]["compiled_ms"], "gpt2 compiled_ms")
    assert "### 7. Cost of the features" in (results / "summary.md").read_text()


def test_summary_has_the_goal_table(results: pathlib.Path):
    text = (results / "summary.md").read_text()
    assert "| Study | Measured | Goal | Status |" in text
    for row in (
        "| 1. Bandwidth, float32",
        "| 2. Leaf scaling",
        "| 3. Distributed, 4 gloo ranks, dense",
        "| 3. Distributed, 4 gloo ranks, ep",
        "| 5. GPU",
        "| 6. Host time vs ranks (fake PG), 64 → 1,024 ranks",
    ):
        assert row in text, row
    assert "not measured" in text


def test_gpu_study_runs_its_variants_on_the_cpu_at_smoke_size(tmp_path: pathlib.Path):
    # The GPU study is study 1 on other shapes and a device; here it runs with
    # the CPU as its device, to check the script before a GPU session needs it.
    _run_study("gpu_study", tmp_path, 180, "--device", "cpu")
    data = _load(tmp_path, "gpu")
    assert data["measured"] is True and data["device"] == "cpu"
    assert data["model"]["leaves"] == 2 * 9 + 3
    assert not data["errors"], data["errors"]
    d = data["dtypes"]["bfloat16"]
    assert set(d["fraction_of_bound"]) == set(d["ms"]) - {"bound_inplace", "bound_pure"}
    _positive_numbers(d, "gpu", "ms", "fraction_of_bound")


def test_agree_cost_measures_both_checks_on_two_ranks(tmp_path: pathlib.Path):
    _run_study("agree_cost", tmp_path, 300)
    data = json.loads((tmp_path / "agree_cost.json").read_text())
    assert data["ranks"] == 2 and data["quick"] is True
    cases = [row["case"] for row in data["rows"]]
    assert any(c.startswith("adaptive_clip_grad_norm_") for c in cases) and any("compiled" in c for c in cases)
    for row in data["rows"]:
        _positive_numbers({k: row[k] for k in ("with_ms", "without_ms", "ratio")}, row["case"])
    _positive_numbers(data["alone_us"], "check alone")
    _positive_numbers(data["in_place_us"], "each piece of the checks, timed inside the clip")
    launched = data["smallest_launches"]  # the smallest adaptive clip, in processes of its own
    assert len(launched["rows"]) == len(launched["ratios"]) == 1, launched
    _positive_numbers({"median_ratio": launched["median_ratio"]}, "smallest adaptive clip, launched apart")


def test_optimizer_schema_and_what_a_skipped_step_allocates(results: pathlib.Path):
    data = _load(results, "optimizer")
    assert {s["dtype"] for s in data["settings"]} == {"float32", "bfloat16"}
    for s in data["settings"]:
        _positive_numbers(s["eager_ms"], f"{s['setting']} eager_ms")
        _positive_numbers(s["eager_ratio_vs_torch"], f"{s['setting']} eager_ratio_vs_torch")
        # What the handed step's time is made of, each over the fused step alone.
        _positive_numbers(s["eager_ratio_vs_step"], f"{s['setting']} eager_ratio_vs_step")
        assert {"scaled_step_only", "norm_only", "torch_norm_only", "read_only"} <= set(s["eager_ratio_vs_step"])
        b = s["bytes_allocated"]
        # Not a timing: what is allocated. A step skipped by the fused kernel allocates nothing
        # beyond the norm's own statistics; the undo-based skip copies every parameter at least.
        assert b["handed_skipped"] - b["norm_only"] < 0.01 * s["grad_bytes"], b
        assert b["skip_update"] >= s["grad_bytes"], b
    assert "### 8. The whole optimizer step" in (results / "summary.md").read_text()


def test_busy_study_times_both_clips_idle_and_with_the_other_cores_busy(tmp_path: pathlib.Path):
    _run_study("busy_study", tmp_path, 180)  # a spinner not stopped would be left behind
    data = _load(tmp_path, "busy")
    assert data["quick"] is True and data["runs"] >= 5
    for point in data["points"]:
        conditions = {(c["load"], c["threads"]): c for c in point["conditions"]}
        assert set(conditions) == {(load, t) for load in ("idle", "busy") for t in (1, 2)}
        for (load, threads), c in conditions.items():
            # Every core but the first spins while the busy conditions are timed.
            assert c["spinners"] == (data["cores"] - 1 if load == "busy" else 0), c
            _positive_numbers({**c["ms"], "ratio": c["ours_over_torch"]}, f"{point['dtype']} {load} {threads}")


def test_write_back_study_times_each_way_of_keeping_the_state_and_they_agree(tmp_path: pathlib.Path):
    _run_study("write_back_study", tmp_path, 240)
    data = _load(tmp_path, "write_back")
    assert set(data["ms"]) == {"returned", "write_back", "copied_after", "in_place"}
    _positive_numbers({**data["ms"], **data["ratio_vs_returned"]}, "write_back")
    # The same steps from the same state, the state kept three ways: the same state at the end.
    assert max(data["max_rel_diff_vs_returned"].values()) < 1e-6, data["max_rel_diff_vs_returned"]


def test_sweep_eager_only_times_the_eager_clips_and_compiles_nothing(tmp_path: pathlib.Path):
    _run_study("sweep_study", tmp_path, 180, "--eager-only", "--dtypes", "float32")
    data = _load(tmp_path, "sweep")
    points = data["series"]["fixed_total"] + data["series"]["fixed_leaf"]
    assert points and not data["series"]["step"] and not data["series"]["dtensor"]
    for p in points:
        assert set(p["ms"]) == {"torch_eager", "ours_eager"}, p["ms"]
        assert not p["compile_s"], p["compile_s"]
        _positive_numbers({**p["ms"], **p["ratio_ours_over_torch"]}, f"{p['leaves']} x {p['leaf_size']}")
        assert p["rel_error"]["ours_eager"] < 1e-6, p["rel_error"]
