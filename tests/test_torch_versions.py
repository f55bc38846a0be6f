"""Any torch from the oldest tested release on: never refused, never replaced, and a clear error if moved.

* The requirement has a lower bound at the oldest release tested and no
  upper bound: it admits every newer release, and installing the package
  next to the running torch leaves that torch where it is (pip resolves it
  offline and plans to install nothing else).
* A torch newer than the newest tested gets one warning per process, never
  a refusal.
* A torch internal the clip relies on that is missing, or has changed shape,
  raises :class:`~ppclip_func.UnsupportedTorchError` at the first call that
  needs it, naming the torch release, the missing piece and the tested
  range. Simulated here by taking each piece away from the running torch.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import ppclip_func
from ppclip_func import UnsupportedTorchError, UntestedTorchWarning, clip_grad_norm
from ppclip_func._base import torch_compat as _torch
from tests._fake_pg import fake_world

REPO = pathlib.Path(__file__).resolve().parent.parent


def _torch_requirement() -> str:
    text = (REPO / "pyproject.toml").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("dependencies = ")]
    (req,) = json.loads(line.split("=", 1)[1])
    return req


def _admits(requirement: str, versions: list[str]) -> list[bool]:
    """Whether pip's own requirement parser admits each version (pre-releases too), in a child process:
    importing pip here would load the standard library's distutils before setuptools' own."""
    script = (
        "import json, sys; from pip._vendor.packaging.requirements import Requirement\n"
        "req = Requirement(sys.argv[1])\n"
        "print(json.dumps([req.name, [req.specifier.contains(v, prereleases=True) for v in sys.argv[2:]]]))"
    )
    proc = subprocess.run([sys.executable, "-c", script, requirement, *versions], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    name, admitted = json.loads(proc.stdout)
    assert name == "torch", requirement
    return admitted


# --- the requirement ----------------------------------------------------------------------------------


def test_the_requirement_starts_at_the_oldest_tested_release_and_has_no_upper_bound():
    req = _torch_requirement()
    assert req == f"torch>={_torch.TESTED_OLDEST.rsplit('.', 1)[0]}", req
    newer = ["2.14.1", "2.15.0", "2.16.0", "3.0.0", "2.15.0+cu130", "2.16.0.dev20270101", torch.__version__]
    assert all(_admits(req, [_torch.TESTED_OLDEST, *newer])), dict(zip(newer, _admits(req, newer)))
    assert _admits(req, ["2.10.0"]) == [False]


def test_installing_next_to_the_running_torch_leaves_it_untouched(tmp_path: pathlib.Path):
    # pip resolves this tree's requirements against the environment, offline. A requirement that
    # excluded the running torch would fail here (no index), or plan to install a torch found on
    # this machine's find-links: either way torch would be in the plan.
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation", "-q"]
    proc = subprocess.run(
        [*cmd, "--report", str(report), str(REPO)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, f"pip could not install the package next to torch {torch.__version__}:\n{proc.stderr}"
    planned = [item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]]
    assert set(planned) <= {"ppclip-func", "ppclip_func"}, f"pip would also install {planned}"


# --- a newer torch: one warning, no refusal ----------------------------------------------------------


@pytest.fixture
def not_warned_yet(monkeypatch):
    monkeypatch.setattr(_torch, "_WARNED", [False])


@pytest.mark.parametrize("version", ["2.15.0", "2.15.0+cu130", "2.16.0.dev20270101+cpu", "3.0.0"])
def test_a_newer_torch_gets_one_warning_per_process(not_warned_yet, version):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _torch.warn_if_untested(version)
        assert not _torch.warn_if_untested(version)
    (w,) = caught
    assert issubclass(w.category, UntestedTorchWarning)
    assert version in str(w.message) and _torch.TESTED_NEWEST in str(w.message)


@pytest.mark.parametrize("version", ["2.11.0", "2.12.1", "2.13.0+cpu", "2.14.1+cu130", "2.14.0"])
def test_a_tested_torch_gets_no_warning(not_warned_yet, version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _torch.warn_if_untested(version)


def test_the_package_imports_and_clips_under_a_newer_torch_version_string():
    # The release number alone refuses nothing: a fresh interpreter told it runs torch 2.15.0.
    script = (
        "import warnings, torch; torch.__version__ = '2.15.0'\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import ppclip_func\n"
        "_, total = ppclip_func.clip_grad_norm({'w': torch.full((4,), 3.0)}, None, max_norm=1.0)\n"
        "print(float(total), sum(issubclass(x.category, ppclip_func.UntestedTorchWarning) for x in w))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    total, warned = proc.stdout.split()
    assert float(total) == pytest.approx(6.0) and warned == "1", proc.stdout


# --- a missing or reshaped internal: one clear error at the first call that needs it ---------------------


def _assert_names(error: pytest.ExceptionInfo, piece: str) -> None:
    text = str(error.value)
    for part in (piece, f"torch {torch.__version__}", f"torch {_torch.TESTED_OLDEST} to {_torch.TESTED_NEWEST}"):
        assert part in text, f"{part!r} not in {text!r}"


@pytest.fixture
def world_of_8():
    with fake_world(8):
        yield init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))


GRADS = {"w": torch.full((4,), 3.0)}


def test_a_pipeline_mesh_without_its_root(world_of_8, monkeypatch):
    pp_mesh = world_of_8["pp"]  # (slicing reads the root too)
    monkeypatch.delattr(DeviceMesh, "_get_root_mesh")
    with pytest.raises(UnsupportedTorchError) as e:
        clip_grad_norm(GRADS, None, 1.0, pp_mesh=pp_mesh)
    _assert_names(e, "DeviceMesh._get_root_mesh")


def test_a_pipeline_mesh_whose_layout_has_another_shape(world_of_8, monkeypatch):
    pp_mesh = world_of_8["pp"]
    monkeypatch.setattr(pp_mesh, "_rank_map", pp_mesh._rank_map.tolist())  # there, but not the tensor it was
    with pytest.raises(UnsupportedTorchError) as e:
        clip_grad_norm(GRADS, None, 1.0, pp_mesh=pp_mesh)
    _assert_names(e, "DeviceMesh._layout.remap_to_tensor")
    assert "has another shape" in str(e.value)


def test_a_sub_mesh_without_the_roots_flattened_meshes(world_of_8, monkeypatch):
    stage_mesh = world_of_8["dp", "tp"]
    monkeypatch.setattr(world_of_8, "_flatten_mapping", None)
    with pytest.raises(UnsupportedTorchError) as e:
        clip_grad_norm(GRADS, stage_mesh, 1.0)
    _assert_names(e, "DeviceMesh._flatten_mapping")


def test_the_same_calls_clip_with_the_pieces_in_place(world_of_8):
    # The three calls above, with nothing taken away (the world's copy of each grad is the same).
    stage_mesh = world_of_8["dp", "tp"]
    world_of_8["dp", "tp"]._flatten()
    _, by_stages = clip_grad_norm(GRADS, None, 1.0, pp_mesh=world_of_8["pp"])
    _, on_the_stage = clip_grad_norm(GRADS, stage_mesh, 1.0)
    # The fake group moves no data: each rank's sum is its own share (one copy per stage over 4 ranks).
    assert float(by_stages) == pytest.approx(math.sqrt(36.0 / 4))
    assert float(on_the_stage) == pytest.approx(math.sqrt(36.0 / 4))


def test_a_process_group_that_cannot_be_resolved(monkeypatch):
    monkeypatch.delattr(dist.distributed_c10d, "_resolve_process_group")
    with pytest.raises(UnsupportedTorchError) as e:
        _torch.resolve_group("0")
    _assert_names(e, "_resolve_process_group")


def test_no_gather_at_all(monkeypatch):
    monkeypatch.setattr(dist, "all_gather_single", None, raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", None)
    with pytest.raises(UnsupportedTorchError) as e:
        _torch.all_gather_into(torch.empty(2), torch.empty(1), None)
    _assert_names(e, "all_gather_single or all_gather_into_tensor")


def test_without_the_native_grouping_the_leaves_are_grouped_alike(monkeypatch):
    leaves = [torch.ones(2), torch.ones(3, dtype=torch.float64), torch.ones(1), torch.ones(2, dtype=torch.bfloat16)]
    native = _torch.group_natively(leaves)
    monkeypatch.setattr(_torch, "_GROUP_BY_DEVICE_AND_DTYPE", None)
    assert _torch.group_natively(leaves) is None
    clipped, total = clip_grad_norm(dict(enumerate(leaves)), None, 0.5)
    assert float(total) == pytest.approx(math.sqrt(8.0), rel=1e-6)
    assert all(clipped[i].dtype == t.dtype for i, t in enumerate(leaves))
    if native is not None:
        assert {k: v[1] for k, v in native.items()} == {
            (torch.device("cpu"), torch.float32): [0, 2],
            (torch.device("cpu"), torch.float64): [1],
            (torch.device("cpu"), torch.bfloat16): [3],
        }


def test_the_errors_are_public():
    assert issubclass(ppclip_func.UnsupportedTorchError, RuntimeError)
    assert "UnsupportedTorchError" in ppclip_func.__all__ and "UntestedTorchWarning" in ppclip_func.__all__
