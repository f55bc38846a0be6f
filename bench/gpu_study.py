"""Study 5, one GPU: study 1 on CUDA with bf16 Llama-3-8B-shaped gradients.

The same variants as :mod:`bench.bandwidth_study` (torch's eager foreach clip,
torch's clip compiled, ours eager and compiled, pure and in place), on 291
leaves and 8.03 G bf16 elements (16 GB of gradients; about 90 GB of device
memory in all, with the flat buffers of the bound and the pure API's outputs).
Each variant is reported in ms and as the fraction of the HBM bound measured
in the same run: ``flat.sum()`` plus ``flat.mul_(c)`` over one flat buffer of
the same size (``torch.mul(flat, c, out=other)`` for the pure API), timed to
``torch.cuda.synchronize()``. ``bound_GBps`` is the HBM traffic of the bound
(three passes over the buffer) per second: what this GPU reaches, to set
against its nominal peak (H100 SXM 3.35 TB/s, H200 4.8 TB/s, from NVIDIA's
data sheets).

It then runs study 9's sweep (:mod:`bench.sweep_study`) on the same device:
torch's clip and ours, eager and compiled, over leaf counts and leaf sizes,
fp32 and bf16, into ``sweep_cuda.json``.

Then the whole optimizer step captured in a CUDA graph (``capture`` in
``gpu.json``, :func:`capture_study`): eager against a manual
``torch.cuda.graph`` capture replayed and against ``torch.compile(mode=
"reduce-overhead")``, at a host-bound size (100 leaves of 4 K elements) and
a memory-bound one (100 leaves of 1 M: 105 M elements), fp32. Ours: the
clip handed to ``AdamW(fused=True, capturable=True)``
(``clip_grad_norm_in_optimizer``) and the pure ``clip_grad_norm`` with
torch's functional ``adamw``; torch's: ``clip_grad_norm_(foreach=True)``
with the same two optimizers, captured the same ways. (The fused
``step()`` does not compile into a graph, so the fused pair has no
compiled row.)

The run is one prepared command (most of it inductor compiling)::

    python -m bench.gpu_study                 # needs CUDA; writes bench/results/gpu.json
    python -m bench.gpu_study --capture-only  # the capture entry alone, into the gpu.json already there
    python -m bench.gpu_study --quick --device cpu   # smoke test: 2 small blocks, aot_eager, eager steps

``python -m bench`` runs it when ``torch.cuda.is_available()``, and records
"not measured" otherwise.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
import traceback
import warnings
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters
from torch.optim.adamw import adamw

from bench import bandwidth_study, sweep_study
from bench._report import RESULTS, write_result
from bench._shapes import llama3_8b_shapes, make_grads, make_params
from bench._timing import interleaved
from ppclip_func import clip_grad_norm, clip_grad_norm_in_optimizer

NAME = "gpu"


def run(
    quick: bool = False,
    out: pathlib.Path | None = None,
    device: str = "cuda",
    sweep: str | None = None,
    capture: str | None = None,
    capture_only: bool = False,
) -> dict:
    """Measures every variant in bf16 on ``device``; writes ``<out>/gpu.json`` and returns it.

    ``sweep`` is study 9's size here: ``"full"``, ``"quick"`` or ``"none"``
    (default: quick with ``quick``, else full; the full sweep compiles 32
    points with inductor, longer than a short GPU lease). ``capture`` is
    :func:`capture_study`'s, the same way. ``capture_only``: that entry
    alone, written into the ``gpu.json`` already in ``out`` (the rest of it
    kept as it is).
    """
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the GPU study needs CUDA (torch.cuda.is_available() is False)")
    capture = capture or ("quick" if quick else "full")
    if capture_only:
        path = (out or RESULTS) / f"{NAME}.json"
        kept = json.loads(path.read_text()) if path.exists() else {"study": NAME, "measured": False}
        kept["capture"] = capture_study(quick=capture == "quick", device=device)
        write_result(kept, out)
        return kept
    layers, scale = (2, 64) if quick else (32, 1)
    runs, warmup = (5, 1) if quick else (7, 2)
    backend = "aot_eager" if quick else "inductor"
    body = bandwidth_study.measure(
        llama3_8b_shapes(layers, scale), (torch.bfloat16,), device=device, runs=runs, warmup=warmup, backend=backend
    )
    body["model"]["shapes"] = f"Llama-3-8B, {layers} layers, widths / {scale}"
    result = {"study": NAME, "measured": True, "quick": quick, **body}
    if torch.device(device).type == "cuda":
        result["cpu_offload"] = _cpu_offload_check()
    # Study 9's sweep on the same device: compiled and eager, leaf counts and sizes (sweep_cuda.json).
    sweep = sweep or ("quick" if quick else "full")
    if sweep == "none":
        result["sweep"] = {"study": None, "points": 0, "why": "not run (--sweep none)"}
    else:
        swept = sweep_study.run(quick=sweep == "quick", out=out, device=device)
        result["sweep"] = {"study": swept["study"], "points": sum(len(v) for v in swept["series"].values())}
    if capture == "none":
        result["capture"] = {"why": "not run (--capture none)"}
    else:
        result["capture"] = capture_study(quick=capture == "quick", device=device)
    write_result(result, out)
    return result


# --- The whole step captured: eager against CUDA graphs ---------------------------------------

# (leaves, elements per leaf): host-bound (a few hundred small kernels a step) and memory-bound.
CAPTURE_SIZES = {"small": (100, 4096), "medium": (100, 1 << 20)}
CAPTURE_QUICK = {"small": (10, 4096)}
CAPTURE_LR = 1e-12  # the parameters barely move over the rounds; the kernels run all the same
# Each implementation and the ways it runs: "graph" is torch.cuda.graph, "compiled" reduce-overhead.
CAPTURE_IMPLS = {
    "torch_fused": ("eager", "graph"),
    "ours_handed": ("eager", "graph"),
    "torch_functional": ("eager", "graph", "compiled"),
    "ours_functional": ("eager", "graph", "compiled"),
}
CAPTURE_PAIRS = {"fused": ("ours_handed", "torch_fused"), "functional": ("ours_functional", "torch_functional")}


def capture_study(quick: bool = False, device: str = "cuda") -> dict:
    """Step time (clip + AdamW), eager and captured, ours and torch's, at each size; the ``capture`` entry.

    Per size: ``ms_per_step`` of each ``<impl>_<mode>``; ``captured_over_eager``
    (captured time over the same implementation's eager time, per round);
    ``ours_over_torch`` per optimizer and mode; ``compile_s`` (the first two
    calls of a reduce-overhead step: compile, warm-up, recording); and the
    cudagraph skips and partitions inductor counted (0 when every compiled
    step is one graph). On a device other than CUDA only the eager steps run,
    at the quick size: a check of the script.
    """
    dev = torch.device(device)
    on_cuda = dev.type == "cuda"
    sizes = CAPTURE_QUICK if quick or not on_cuda else CAPTURE_SIZES
    runs = 5 if quick else 9
    result: dict = {"dtype": "float32", "lr": CAPTURE_LR, "runs": runs, "impls": CAPTURE_IMPLS, "sizes": {}}
    if not on_cuda:
        result["not_run"] = "graph and compiled: CUDA graphs need CUDA"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
        for name, (leaves, leaf_numel) in sizes.items():
            result["sizes"][name] = _capture_point(leaves, leaf_numel, dev, runs)
            torch._dynamo.reset()  # frees the recorded graphs' memory before the next size
    return result


def _capture_point(leaves: int, leaf_numel: int, device: torch.device, runs: int) -> dict:
    on_cuda = device.type == "cuda"
    repeat = 20 if leaves * leaf_numel < 1 << 24 else 3  # steps per timed call: many where a step is short
    variants: dict[str, Callable[[], object]] = {}
    errors: dict[str, str] = {}
    compile_s: dict[str, float] = {}
    before = dict(counters["inductor"])
    for impl, modes in CAPTURE_IMPLS.items():
        params = make_params(make_grads([(leaf_numel,)] * leaves, torch.float32, device=device))
        for p in params:
            p.data.zero_()
        step = (_fused_step if impl.endswith("fused") else _functional_step)(impl, params, device)
        for mode in modes if on_cuda else ("eager",):
            name = f"{impl}_{mode}"
            try:
                if mode == "eager":
                    variants[name] = step
                elif mode == "graph":
                    variants[name] = _graphed(step)
                else:
                    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
                    t0 = time.perf_counter()
                    for _ in range(2):  # compile and warm-up, then recording
                        torch.compiler.cudagraph_mark_step_begin()
                        compiled()
                    torch.cuda.synchronize(device)
                    compile_s[name] = time.perf_counter() - t0
                    variants[name] = lambda c=compiled: (torch.compiler.cudagraph_mark_step_begin(), c())
            except Exception as e:  # recorded, not hidden: the other variants are still measured
                errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                traceback.print_exc()

    def timed(fn: Callable[[], object]) -> Callable[[], None]:
        def call() -> None:
            for _ in range(repeat):
                fn()
            if on_cuda:
                torch.cuda.synchronize(device)

        return call

    t = interleaved({k: timed(f) for k, f in variants.items()}, runs=runs, warmup=1, shuffle=True)
    done = set(t.samples)
    return {
        "leaves": leaves,
        "leaf_numel": leaf_numel,
        "elements": leaves * leaf_numel,
        "repeat": repeat,
        "ms_per_step": {k: v / repeat for k, v in t.all_ms().items()},
        "captured_over_eager": {
            k: t.ratio(k, f"{k.rsplit('_', 1)[0]}_eager")
            for k in done
            if not k.endswith("_eager") and f"{k.rsplit('_', 1)[0]}_eager" in done
        },
        "ours_over_torch": {
            f"{pair}_{mode}": t.ratio(f"{ours}_{mode}", f"{theirs}_{mode}")
            for pair, (ours, theirs) in CAPTURE_PAIRS.items()
            for mode in ("eager", "graph", "compiled")
            if f"{ours}_{mode}" in done and f"{theirs}_{mode}" in done
        },
        "compile_s": compile_s,
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - before.get("cudagraph_skips", 0),
        "cudagraph_partitions": counters["inductor"]["cudagraph_partitions"] - before.get("cudagraph_partitions", 0),
        "errors": errors,
    }


def _fused_step(impl: str, params: list[torch.nn.Parameter], device: torch.device) -> Callable[[], None]:
    """The clip, then ``AdamW(fused=True)``'s step (capturable on CUDA): torch's clip in place, or ours handed over."""
    opt = torch.optim.AdamW(params, lr=CAPTURE_LR, fused=True, capturable=device.type == "cuda")

    def step() -> None:
        if impl == "torch_fused":
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        else:
            clip_grad_norm_in_optimizer(opt, params, None, 1.0)
        opt.step()

    return step


def _functional_step(impl: str, params: list[torch.nn.Parameter], device: torch.device) -> Callable[[], None]:
    """The clip (torch's in place, or our pure one), then torch's functional ``adamw`` in place (foreach;
    capturable on CUDA, its step counts float64 tensors there), its state marked static for cudagraph trees."""
    grads = [p.grad for p in params]
    exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), dtype=torch.float64, device=device) for _ in params]
    for t in (*grads, *exp_avgs, *exp_avg_sqs, *steps):
        torch._dynamo.mark_static_address(t)
    hyper = {"amsgrad": False, "beta1": 0.9, "beta2": 0.95, "weight_decay": 0.1, "eps": 1e-8, "maximize": False}

    def step() -> None:
        with torch.no_grad():
            if impl == "torch_functional":
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                clipped = grads
            else:
                clipped = clip_grad_norm(grads, None, 1.0)[0]
            adamw(
                params, clipped, exp_avgs, exp_avg_sqs, [], steps, foreach=True,
                capturable=device.type == "cuda", lr=CAPTURE_LR, **hyper,
            )  # fmt: skip

    return step


def _graphed(step: Callable[[], None], warmup: int = 3) -> Callable[[], None]:
    """``step`` captured in a CUDA graph after ``warmup`` calls on a side stream; returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def print_capture(capture: dict) -> None:
    """One line per size: ms per step of each variant, and ours over torch's."""
    for name, point in capture.get("sizes", {}).items():
        steps = ", ".join(f"{k} {v:.3g}" for k, v in point["ms_per_step"].items())
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in point["ours_over_torch"].items())
        print(
            f"capture, {name} ({point['leaves']} leaves of {point['leaf_numel']:,} elements): ms/step {steps}; ours/torch {ratios}"
        )
        if point["errors"]:
            print(f"  errors: {point['errors']}")


def _cpu_offload_check() -> dict:
    """FSDP2 CPU offload (pytorch#148532): CPU grads over a CUDA mesh must reduce on the GPU.

    Runs the unit check of ``tests/test_devices.py`` on 4 fake ranks in this
    process (a fake process group: one GPU cannot host real NCCL peers).
    """
    from tests.test_devices import offloaded_clip_reduces_on_the_gpu

    devices, total = offloaded_clip_reduces_on_the_gpu()
    return {"collective_devices": devices, "norm": total, "ok": [d.split(":")[0] for d in devices] == ["cuda"]}


def plot(result: dict, path: pathlib.Path) -> None:
    """The bandwidth study's bar chart, for the one dtype measured here."""
    bandwidth_study.plot(result, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 small blocks, aot_eager: a smoke test")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--sweep", choices=("full", "quick", "none"), help="study 9 here (default: as --quick)")
    parser.add_argument("--capture", choices=("full", "quick", "none"), help="the captured step (default: as --quick)")
    parser.add_argument("--capture-only", action="store_true", help="the captured step alone, into the gpu.json there")
    args = parser.parse_args()
    r = run(args.quick, args.out, args.device, args.sweep, args.capture, args.capture_only)
    if not args.capture_only:
        print(f"{r['device']}: {r['model']['params'] / 1e9:.2f} G bf16 params in {r['model']['leaves']} leaves")
        bandwidth_study.print_result(r)
    print_capture(r["capture"])


if __name__ == "__main__":
    main()
