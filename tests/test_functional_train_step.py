"""docs/examples/functional_train_step.py: a functional training step compiled as one graph equals eager torch.

The example's step (``torch.func.grad_and_value`` over ``functional_call``,
``adaptive_clip_grad_norm`` over a one-rank gloo mesh, torch's functional
``adamw`` on clones, ``select_update``) is compiled with ``fullgraph=True``
by inductor, through a backend that keeps the graphs it compiles, with
recompiles made errors. The batches include a spike (ZClip clips it) and a
NaN batch (the step is skipped). The reference is the obvious eager loop
from the same weights on the same batches: ``loss.backward()``,
``adaptive_clip_grad_norm_`` on ``.grad``, and
``torch.optim.AdamW(foreach=False).step()`` unless ``stats.skip``. After
every step each parameter must agree within 1e-6 relative. The same step
is also run as docs/cuda-graphs.md captures it (its state marked static
and written back in place), and traced to its aten graph: no host sync,
no input written.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from ppclip_func import adaptive_clip_grad_norm_, init_clip_state, write_back_
from tests._fake_pg import one_rank_world
from tests.test_compile_fake_pg import HOST_SYNC_OPS, CaptureBackend, aten_ops

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "functional_train_step.py"
STEPS = 12
SPIKE, NAN = 8, 10  # after the clip's warm-up (5 steps)
REL = 1e-6


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_examples_functional_train_step", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dynamo looks a traced function's module up by name
    spec.loader.exec_module(module)
    return module


example = _load_example()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The example's batches, with a spike (inputs and targets 30 times larger) and a NaN input."""
    out = example.batches(STEPS)
    x, y = out[SPIKE]
    out[SPIKE] = (30 * x, 30 * y)
    x, y = out[NAN]
    out[NAN] = (x.clone().index_fill_(0, torch.tensor([3]), math.nan), y)
    return out


class GraphKeeper:
    """Inductor, keeping each dynamo graph once its compile returns (dynamo may abandon an attempt and
    restart its analysis: not a second graph)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self._inductor = lookup_backend("inductor")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        compiled = self._inductor(gm, example_inputs)
        self.graphs.append(gm)
        return compiled


def test_the_script_runs(capsys):
    """``main()`` as ``python docs/examples/functional_train_step.py`` runs it (its own one-rank group)."""
    torch._dynamo.reset()
    example.main(steps=3)
    torch._dynamo.reset()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["step", "0"], ["step", "1"], ["step", "2"]], lines
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def one_rank_mesh() -> Iterator[DeviceMesh]:
    """A one-rank gloo group and mesh in this process, as the example's ``main`` makes them."""
    with one_rank_world() as mesh:
        yield mesh


def _record(run: dict, loss: torch.Tensor, stats, params: dict[str, torch.Tensor]) -> None:
    run["losses"].append(float(loss.detach()))
    run["norms"].append(float(stats.total_norm))
    run["thresholds"].append(float(stats.threshold))
    run["skips"].append(bool(stats.skip))
    run["params"].append({n: p.detach().clone() for n, p in params.items()})
    run["clip_states"].append([t.detach().clone() for t in stats.state])


def _empty_run() -> dict:
    return {"losses": [], "norms": [], "thresholds": [], "skips": [], "params": [], "clip_states": []}


@pytest.fixture(scope="module")
def compiled_run(one_rank_mesh: DeviceMesh) -> dict:
    """The example's step, compiled, over ``batches()``: what each step returned, and the graphs."""
    torch._dynamo.reset()
    counters.clear()
    model = example.make_model()
    params, opt_state, clip_state = example.init_state(model)
    keeper = GraphKeeper()
    step = torch.compile(example.make_train_step(model, one_rank_mesh), backend=keeper, fullgraph=True)
    run = _empty_run()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for x, y in batches():
            params, opt_state, clip_state, loss, stats = step(params, opt_state, clip_state, x, y)
            _record(run, loss, stats, params)
    run["graphs"] = keeper.graphs
    run["unique_graphs"] = counters["stats"]["unique_graphs"]
    run["graph_breaks"] = dict(counters["graph_break"])
    run["adamw_steps"] = {n: float(t) for n, t in opt_state["step"].items()}
    run["clip_count"] = int(clip_state.count)
    run["clip_state"] = [t.clone() for t in clip_state]
    torch._dynamo.reset()
    return run


def eager_torch_run(mesh: DeviceMesh) -> dict:
    """The same steps the obvious way: autograd, the in-place clip on ``.grad``, torch's AdamW class."""
    model = example.make_model()
    hp = example.ADAMW
    betas = (hp["beta1"], hp["beta2"])
    opt = torch.optim.AdamW(
        model.parameters(), lr=hp["lr"], betas=betas, weight_decay=hp["weight_decay"], eps=hp["eps"], foreach=False
    )
    state = init_clip_state()
    run = _empty_run()
    for x, y in batches():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        stats = adaptive_clip_grad_norm_(model.parameters(), mesh, state, **example.CLIP)
        state = stats.state
        if not stats.skip:
            opt.step()
        _record(run, loss, stats, dict(model.named_parameters()))
    return run


def test_the_step_is_one_graph_with_one_collective_and_never_recompiles(compiled_run):
    # error_on_recompile=True during the run: a recompile after the first step, the spike's or the NaN's
    # included, would have raised.
    assert len(compiled_run["graphs"]) == 1, f"{len(compiled_run['graphs'])} graphs compiled"
    assert compiled_run["unique_graphs"] == 1
    assert compiled_run["graph_breaks"] == {}
    ops = [str(n.target) for n in compiled_run["graphs"][0].graph.nodes if n.op == "call_function"]
    collectives = [op for op in ops if "c10d" in op]
    assert collectives == ["_c10d_functional.all_reduce", "_c10d_functional.wait_tensor"], collectives


def test_the_step_reads_nothing_on_the_host_and_writes_none_of_its_inputs(one_rank_mesh):
    """What ``mode="reduce-overhead"`` needs of it (docs/cuda-graphs.md): no host sync in the graph,
    and no input written (AOTAutograd would write a mutated input back after the graph: its version
    counter would move)."""
    torch._dynamo.reset()
    model = example.make_model()
    state = example.init_state(model)
    backend = CaptureBackend()
    step = torch.compile(example.make_train_step(model, one_rank_mesh), backend=backend, fullgraph=True)
    for x, y in batches()[:3]:
        inputs = [t for t in pytree.tree_leaves((*state, x, y)) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in inputs]
        *state, _, _ = step(*state, x, y)
        assert [t._version for t in inputs] == versions, "the step wrote one of its inputs"
    torch._dynamo.reset()
    assert backend.frames == 1 and len(backend.aten) == 1
    ops = aten_ops(backend.aten[0])
    assert [op for op in ops if op in HOST_SYNC_OPS] == []
    assert [op for op in ops if "c10d" in op] == ["_c10d_functional::all_reduce", "_c10d_functional::wait_tensor"]


def test_the_compiled_step_equals_eager_torch_at_every_step(compiled_run, one_rank_mesh):
    want = eager_torch_run(one_rank_mesh)
    got = compiled_run
    assert want["skips"] == [i == NAN for i in range(STEPS)], want["skips"]
    assert got["skips"] == want["skips"], got["skips"]
    # Not vacuous: the spike was clipped, below its norm and below max_norm (ZClip's threshold, not the cap).
    assert want["thresholds"][SPIKE] < min(want["norms"][SPIKE], example.CLIP["max_norm"]), want
    for step in range(STEPS):
        for what in ("norms", "thresholds"):
            a, b = got[what][step], want[what][step]
            same = a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= REL * abs(b)
            assert same, f"step {step}: {what} {a!r} vs eager {b!r}"
        for name, expected in want["params"][step].items():
            actual = got["params"][step][name]
            err = float((actual - expected).abs().max() / expected.abs().max())
            assert err <= REL, f"step {step}, {name}: relative error {err:.3g} > {REL:g}"


def test_the_step_written_back_in_place_as_docs_cuda_graphs_captures_it(compiled_run, one_rank_mesh):
    """docs/cuda-graphs.md's first recipe: the state in tensors marked static, the step's results written
    back into them inside the compiled step by one ``write_back_``, the step returning only its loss. On
    the CPU ``mode="reduce-overhead"`` captures nothing; the graph is the one a GPU would capture: one
    graph, no recompile, no host sync, the state's storage kept, and after each step the parameters, the
    optimizer's moments and step counts and the clip's statistics (every field) those of the pure step."""
    torch._dynamo.reset()
    counters.clear()
    model = example.make_model()
    persistent = example.init_state(model)
    params, opt_state, clip_state = persistent
    leaves = pytree.tree_leaves(persistent)
    for t in leaves:
        torch._dynamo.mark_static_address(t)
    train_step = example.make_train_step(model, one_rank_mesh)

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def captured_step(x, y):
        *new, loss, _stats = train_step(*persistent, x, y)
        write_back_(persistent, tuple(new))
        return loss

    storage = [t.data_ptr() for t in leaves]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, (x, y) in enumerate(batches()):
            torch.compiler.cudagraph_mark_step_begin()
            captured_step(x, y)
            for name, want in compiled_run["params"][i].items():
                err = float((params[name] - want).abs().max() / want.abs().max())
                assert err <= REL, f"step {i}, {name}: relative error {err:.3g} > {REL:g}"
            for field, got, want in zip(clip_state._fields, clip_state, compiled_run["clip_states"][i]):
                assert torch.allclose(got, want, rtol=REL, atol=0.0, equal_nan=True), f"step {i}, {field}"
    assert counters["stats"]["unique_graphs"] == 1
    assert dict(counters["graph_break"]) == {}
    assert [t.data_ptr() for t in leaves] == storage
    assert {n: float(t) for n, t in opt_state["step"].items()} == compiled_run["adamw_steps"]
    assert int(clip_state.count) == STEPS - 1  # the NaN step left the statistics alone
    torch._dynamo.reset()


def test_the_written_back_step_reads_nothing_on_the_host_and_writes_the_state_once(one_rank_mesh):
    """The recipe's aten graph: no host sync, and the whole state written by the one write-back op."""
    torch._dynamo.reset()
    model = example.make_model()
    persistent = example.init_state(model)
    train_step = example.make_train_step(model, one_rank_mesh)
    backend = CaptureBackend()

    @torch.compile(backend=backend, fullgraph=True)
    def captured_step(x, y):
        *new, loss, _ = train_step(*persistent, x, y)
        write_back_(persistent, tuple(new))
        return loss

    for x, y in batches()[:2]:
        captured_step(x, y)
    torch._dynamo.reset()
    assert backend.frames == 1 and len(backend.aten) == 1
    graph = backend.aten[0].graph
    ops = aten_ops(backend.aten[0])
    assert [op for op in ops if op in HOST_SYNC_OPS] == []
    writes = [n for n in graph.nodes if n.op == "call_function" and "write_back" in str(n.args) + str(n.target)]
    assert len(writes) == 1, [str(n) for n in writes]


def test_a_skipped_step_moves_nothing(compiled_run):
    before, after = compiled_run["params"][NAN - 1], compiled_run["params"][NAN]
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert math.isnan(compiled_run["norms"][NAN])
    assert set(compiled_run["adamw_steps"].values()) == {STEPS - 1.0}  # the skipped step not counted
    assert compiled_run["clip_count"] == STEPS - 1


def test_the_loss_falls(compiled_run):
    losses = [loss for i, loss in enumerate(compiled_run["losses"]) if i not in (SPIKE, NAN)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(math.isfinite(loss) for loss in losses)
