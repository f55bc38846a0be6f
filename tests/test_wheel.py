"""The wheel holds the library and nothing else, installs into a fresh venv, and clips there.

The wheel is built with ``pip wheel --no-deps --no-build-isolation`` from a
copy of this tree (so the build reads only what is in the tree, and leaves
nothing in it); the build backend, setuptools, comes with the ``test`` extra,
so nothing is fetched. It is installed with ``pip --python`` into a venv
created without pip, whose one link to the test environment is a ``.pth``
line naming the directory torch is installed in: torch is reused, not
installed again. The smoke script runs in isolated mode (``-I``: no
``PYTHONPATH``, no current directory on ``sys.path``), from a directory
outside the tree, so ``ppclip_func`` can only come from the wheel.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "ppclip_func"
# What a build must not see: environments, caches, build outputs, measured results.
NOT_COPIED = (".git", ".venv*", "__pycache__", "*.egg-info", "build", "dist", ".*_cache", ".hypothesis", "results")

SMOKE = textwrap.dedent(
    """
    import importlib.metadata, json, pathlib, sys

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ppclip_func
    from ppclip_func import clip_grad_norm, clip_grad_norm_

    grads = {"emb": torch.full((4,), 3.0), "layers": [torch.full((2, 2), 3.0), None]}
    clipped, total = clip_grad_norm(grads, None, max_norm=1.0)

    # The one collective, on a one-rank mesh: the private torch APIs the package relies on, as installed.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "dp"))
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, 4.0, 0.0])
    mesh_total = clip_grad_norm_([p], mesh, max_norm=1.0)
    dist.destroy_process_group()

    print(json.dumps({
        "file": ppclip_func.__file__,
        "prefix": sys.prefix,
        "version": ppclip_func.__version__,
        "metadata_version": importlib.metadata.version("ppclip_func"),
        "typed": (pathlib.Path(ppclip_func.__file__).parent / "py.typed").is_file(),
        "total": float(total),
        "clipped": clipped["layers"][0].flatten().tolist(),
        "mesh_total": float(mesh_total),
        "mesh_clipped": p.grad.tolist(),
    }))
    """
)


def _source_version() -> str:
    text = (REPO / PACKAGE / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


def _run(cmd: list[str], **kwargs) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("setuptools", minversion="77", reason="the test extra's build backend (setuptools>=77)")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*NOT_COPIED))
    out = tmp / "dist"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q"]
    _run([*pip_wheel, "-w", str(out), str(src)])
    (built,) = out.glob("*.whl")
    return built


def test_wheel_holds_the_library_only(wheel: pathlib.Path):
    version = _source_version()
    assert wheel.name == f"{PACKAGE}-{version}-py3-none-any.whl"
    dist_info = f"{PACKAGE}-{version}.dist-info/"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(dist_info + "METADATA").decode()
    strays = [n for n in names if not n.startswith((f"{PACKAGE}/", dist_info))]
    assert not strays, f"the wheel holds more than the library: {strays}"
    modules = sorted(p.relative_to(REPO).as_posix() for p in (REPO / PACKAGE).glob("*.py"))
    assert modules and set(modules) <= set(names), f"modules missing from the wheel: {set(modules) - set(names)}"
    assert f"{PACKAGE}/py.typed" in names
    assert dist_info + "licenses/LICENSE" in names
    headers = [tuple(line.split(": ", 1)) for line in metadata.split("\n\n", 1)[0].splitlines()]
    assert ("Version", version) in headers
    assert ("License-Expression", "BSD-3-Clause") in headers
    assert ("Requires-Dist", "torch>=2.11") in headers


def test_wheel_installs_into_a_fresh_venv_and_clips(wheel: pathlib.Path, tmp_path: pathlib.Path):
    # No PYTHONPATH: neither pip nor the smoke script may see this tree or what was built in it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=env)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    pip_install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q"]
    _run([*pip_install, str(wheel)], env=env)
    # Then torch (and its dependencies) from the test environment, without installing them again. Only
    # now: pip must not see that environment's packages (an editable ppclip_func) as part of this venv.
    paths = _run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env)
    (pathlib.Path(paths.strip()) / "torch_from_test_env.pth").write_text(
        f"{pathlib.Path(torch.__file__).parent.parent}\n"
    )

    script = tmp_path / "smoke.py"
    script.write_text(SMOKE)
    out = json.loads(_run([str(python), "-I", str(script)], cwd=tmp_path, env=env).splitlines()[-1])

    assert pathlib.Path(out["file"]).is_relative_to(venv), f"ppclip_func came from {out['file']}, not the wheel"
    assert pathlib.Path(out["prefix"]) == venv
    assert out["version"] == out["metadata_version"] == _source_version()
    assert out["typed"]
    assert out["total"] == pytest.approx(72**0.5)
    assert out["clipped"] == pytest.approx([3 / 72**0.5] * 4, rel=1e-5)
    assert out["mesh_total"] == pytest.approx(5.0)
    assert out["mesh_clipped"] == pytest.approx([0.6, 0.8, 0.0], rel=1e-5)
