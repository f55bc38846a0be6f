"""C allocator settings for a benchmark process, and running a module under one.

The pure API returns new tensors: every call allocates as many bytes as the
gradients hold and frees the previous call's outputs. What that costs is
decided by the C allocator under torch's CPU allocator, not by torch: glibc
returns large freed blocks to the OS (``munmap``, heap trimming), and the next
call page-faults them back in, zero-filled by the kernel. The settings here
keep freed memory in the process instead. ``LD_PRELOAD`` and
``GLIBC_TUNABLES`` are read when a process starts, so a setting applies to a
new process: :func:`run_module` starts one.

* ``default``: whatever the environment gives (glibc's malloc on Linux).
* ``glibc-tuned``: glibc told never to ``mmap`` a block for one allocation
  and never to trim the heap: freed blocks stay and are reused.
* ``jemalloc``: jemalloc preloaded, as ``torch.backends.xeon.run_cpu
  --enable-jemalloc`` does, but told to keep freed pages (see
  :data:`JEMALLOC_CONF`).

Both kept settings hold the process's resident memory at its peak, as torch's
CUDA caching allocator does on a GPU.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

__all__ = ["ALLOCATORS", "active", "environment", "find_jemalloc", "run_module", "started_under"]

ALLOCATORS = ("default", "glibc-tuned", "jemalloc")

# mmap_threshold: blocks up to 4 GiB come from the heap, not a fresh mmap each
# (glibc's dynamic threshold stops at 32 MiB, below GPT-2's 206 MB embedding
# grad); trim_threshold: never give the heap's top back to the OS.
GLIBC_TUNABLES = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=4294967296"
# run_cpu sets "oversize_threshold:1,background_thread:true,metadata_thp:auto".
# Measured here, jemalloc faults every page of the outputs back in each call
# with that, with jemalloc's defaults, and with only oversize_threshold:0
# (the huge arena off): its time-based decay purges freed pages between calls
# seconds apart. Decay off keeps them, as glibc-tuned does.
JEMALLOC_CONF = "oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1"
# What marks a process as already started under a setting.
_MARK = "PPCLIP_BENCH_ALLOCATOR"


def find_jemalloc() -> str | None:
    """The path of ``libjemalloc.so*`` (Debian's ``libjemalloc2``, conda, /usr/local), or ``None``."""
    dirs = [f"/usr/lib/{platform.machine()}-linux-gnu", "/usr/lib", "/usr/lib64", "/usr/local/lib"]
    dirs += [f"{os.environ[v]}/lib" for v in ("CONDA_PREFIX", "VIRTUAL_ENV") if v in os.environ]
    for d in dirs:
        found = sorted(glob.glob(f"{d}/libjemalloc.so*"))
        if found:
            return found[0]
    return None


def environment(name: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the allocator setting ``name`` and no other.

    Raises:
        ValueError: ``name`` is not one of :data:`ALLOCATORS`.
        FileNotFoundError: ``name`` is ``"jemalloc"`` and no libjemalloc is installed.
    """
    if name not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {name!r}")
    env = dict(os.environ if base is None else base)
    for var in ("GLIBC_TUNABLES", "MALLOC_CONF"):
        env.pop(var, None)
    preload = [p for p in env.pop("LD_PRELOAD", "").split(":") if p and "jemalloc" not in p]
    if name == "glibc-tuned":
        env["GLIBC_TUNABLES"] = GLIBC_TUNABLES
    elif name == "jemalloc":
        lib = find_jemalloc()
        if lib is None:
            raise FileNotFoundError("libjemalloc is not installed (Debian/Ubuntu: apt-get install libjemalloc2)")
        preload.insert(0, lib)
        env["MALLOC_CONF"] = JEMALLOC_CONF
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env[_MARK] = name
    return env


def active() -> str:
    """The setting this process runs under, read from what is loaded, not from what was asked for."""
    try:
        maps = pathlib.Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    if "libjemalloc" in maps:
        return "jemalloc"
    if "glibc.malloc.mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return "glibc-tuned"
    return "default"


def run_module(module: str, args: list[str], name: str, timeout: float | None = None) -> dict:
    """Runs ``python -m module *args --json PATH`` under the allocator ``name``; returns the JSON it wrote.

    The child's output goes to this process's stdout and stderr.

    Raises:
        RuntimeError: The child failed, or did not run under ``name``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", module, *args, "--json", str(path)]
        proc = subprocess.run(cmd, env=environment(name), timeout=timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} under allocator {name!r} exited with {proc.returncode}")
        result = json.loads(path.read_text())
    if result.get("allocator") != name:
        raise RuntimeError(f"asked for allocator {name!r}, the child ran under {result.get('allocator')!r}")
    return result


def started_under(name: str) -> bool:
    """Whether this process was started by :func:`run_module` (or :func:`environment`) for ``name``."""
    return os.environ.get(_MARK) == name
