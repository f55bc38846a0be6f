"""Where the compile time goes: per-phase compile seconds and graph sizes, ours in place vs torch's clip.

The profile behind study 4's shortfall. For one leaf count (default 145, the
llama-like shapes of ``bench/compile_study.py``), each implementation is
compiled once with inductor and its caches off; recorded are dynamo's
per-phase compile times (``torch._dynamo.utils.compile_times``), the number
of nodes of the FX graph dynamo captured and of the aten graph AOTAutograd
gave inductor, and the op counts of the latter.

    python -m bench.compile_profile [--leaves 145] [--out bench/results/profiles]
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import time

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from bench._shapes import make_grads, make_params
from bench.compile_study import COMPILED, _no_compile_caches, llama_shapes, warm_up_compiler

IMPLS = ("ppclip clip_grad_norm_ (in place)", "torch get_total_norm + clip_grads_with_norm_")


def _graphs(impl: str, params: list) -> dict[str, list]:
    """The FX graph dynamo captures and the aten graph AOTAutograd makes of it (what inductor is given)."""
    graphs: dict[str, list] = {"dynamo": [], "aten": []}

    def keep_aten(gm, example_inputs):
        graphs["aten"].append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        graphs["dynamo"].append(gm)
        return aot_autograd(fw_compiler=keep_aten, inference_compiler=keep_aten)(gm, example_inputs)

    torch._dynamo.reset()
    torch.compile(COMPILED[impl], backend=backend, fullgraph=True)(params, torch.tensor(1.0))
    torch._dynamo.reset()
    return graphs


def _profile(impl: str, n_leaves: int) -> dict:
    grads = make_grads(llama_shapes(n_leaves), torch.float32)
    params = make_params(grads)
    graphs = _graphs(impl, params)
    aten = graphs["aten"][0]
    ops = collections.Counter(
        getattr(n.target, "__name__", str(n.target)) for n in aten.graph.nodes if n.op == "call_function"
    )
    torch._dynamo.reset()
    torch._dynamo.utils.reset_frame_count()
    compiled = torch.compile(COMPILED[impl], backend="inductor", fullgraph=True)
    with _no_compile_caches():
        t0 = time.perf_counter()
        compiled(params, torch.tensor(1.0))
        seconds = time.perf_counter() - t0
    phases = torch._dynamo.utils.compile_times(repr="csv")
    torch._dynamo.reset()
    return {
        "impl": impl,
        "leaves": n_leaves,
        "first_call_s": seconds,
        "dynamo_nodes": len(graphs["dynamo"][0].graph.nodes),
        "aten_nodes": len(aten.graph.nodes),
        "aten_ops": dict(ops.most_common(12)),
        "compile_times_csv": [list(map(str, row)) for row in phases],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=145)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results" / "profiles")
    args = parser.parse_args()
    warm_up_compiler("inductor")
    result = {"leaves": args.leaves, "profiles": [_profile(impl, args.leaves) for impl in IMPLS]}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"compile-{args.leaves}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    for p in result["profiles"]:
        print(f"{p['impl']}: {p['first_call_s']:.1f} s, dynamo nodes {p['dynamo_nodes']}, aten nodes {p['aten_nodes']}")
        print(f"  aten ops: {p['aten_ops']}")
        print(f"  phases: {p['compile_times_csv']}")


if __name__ == "__main__":
    main()
