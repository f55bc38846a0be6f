"""The adaptive state check on CUDA: the path no CPU run takes (skipped without a GPU).

On CUDA nothing is read on the host: the state's fingerprint is taken by
tensor ops on the device, and ranks that disagree stop at a device-side
``torch._assert_async`` (the process must then be restarted). Two gloo ranks
share one GPU (NCCL needs a GPU per rank); gloo all-reduces CUDA tensors.
The disagreement runs in processes of its own: a device-side assert leaves
each rank's CUDA context unusable, and the process must end (torch aborts
in the next tensor's destructor).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pathlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from demo.harness import _free_port
from ppclip_func import adaptive_clip_grad_norm, adaptive_clip_grad_norm_, init_clip_state
from ppclip_func._core import agreement as _agree
from tests._cases import real_rank_test
from tests._collectives import CollectiveCounter
from tests._gather import gather_objects
from tests.test_state_fingerprint import reference

WORLD = 2


def _fresh():
    _agree.forget_configurations()
    torch._dynamo.reset()
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (WORLD,), mesh_dim_names=("dp",))
    torch.manual_seed(dist.get_rank())
    params = {f"layers.{i}.w": torch.nn.Parameter(torch.randn(64, 32, device="cuda")) for i in range(3)}
    for p in params.values():
        p.grad = torch.randn_like(p)
    return mesh, params


def the_digits_on_cuda_are_the_hosts(rank: int, world_size: int) -> None:
    cpu = [torch.tensor(7), torch.tensor(1.5, dtype=torch.float64), torch.randn(5).to(torch.bfloat16)]
    on_gpu = [t.cuda() for t in cpu]
    assert _agree.host_fingerprint(on_gpu) is None  # a CUDA state is not read on the host
    assert _agree.state_fingerprint(on_gpu, torch.device("cuda")).tolist() == reference(cpu)


def agreeing_states_step_on_with_one_all_reduce(rank: int, world_size: int) -> None:
    mesh, params = _fresh()
    state = init_clip_state("cuda")
    for step in range(4):
        with CollectiveCounter() as c:
            state = adaptive_clip_grad_norm_(params, mesh, state, max_norm=1.0, warmup=2).state
        # The first call meets the configuration: the options gather, then the one all-reduce.
        assert c.ops == ["c10d._allgather_base_"] * (step == 0) + ["_c10d_functional.all_reduce"], c.ops
    torch.cuda.synchronize()
    assert int(state.count) == 4
    assert len(set(gather_objects((float(state.mean), float(state.var))))) == 1


def compiled_agreeing_states_step_on(rank: int, world_size: int) -> None:
    mesh, params = _fresh()
    grads = {n: p.grad for n, p in params.items()}
    step = torch.compile(lambda g, s: adaptive_clip_grad_norm(g, mesh, s, max_norm=1.0, warmup=2), fullgraph=True)
    state = init_clip_state("cuda")
    for _ in range(3):
        _, stats = step(grads, state)
        state = stats.state
    torch.cuda.synchronize()
    assert int(state.count) == 3
    assert len(set(gather_objects((float(state.mean), float(state.var))))) == 1


CASES = [
    the_digits_on_cuda_are_the_hosts,
    agreeing_states_step_on_with_one_all_reduce,
    compiled_agreeing_states_step_on,
]

_on_ranks = real_rank_test(CASES, WORLD, case_timeout=240.0)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
def test_on_real_ranks(case) -> None:
    # Asked here, in pytest's process, not when the ranks' fork server imports this module: a process
    # that has asked CUDA cannot give it to the ranks it forks.
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _on_ranks(case)


def _rank_with_its_own_state(rank: int, port: int, out: str) -> None:
    """One rank of two; rank 1's state is not rank 0's. Writes what the rank saw, then leaves at once."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    mesh, params = _fresh()
    state = init_clip_state("cuda")
    adaptive_clip_grad_norm_(params, mesh, state, max_norm=1.0)  # agreeing: the options are checked
    torch.cuda.synchronize()
    if rank == 1:
        state = state._replace(count=torch.tensor(5, device="cuda"))
    adaptive_clip_grad_norm_(params, mesh, state, max_norm=1e-3)  # returns: the stop is on the device
    try:
        torch.cuda.synchronize()
        seen = "no error"
    except Exception as e:
        seen = f"{type(e).__name__}: {e}"
    pathlib.Path(out, f"{rank}.txt").write_text(seen)
    os._exit(0)  # the CUDA context is unusable: a destructor would abort the process


def test_a_state_that_differs_stops_every_rank_at_a_device_side_assert(tmp_path, capfd):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_with_its_own_state, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    # Each rank's device reports the failed assert, with the check's message (the ranks share stderr).
    err = capfd.readouterr().err
    assert err.count("Assertion `ranks hold different adaptive clip states") == 2, err[-3000:]
    for rank, p in enumerate(procs):
        # A rank either saw the error at its synchronize, or torch ended the process before (a freed
        # tensor's destructor meets the broken context and aborts): either way it did not go on.
        report = tmp_path / f"{rank}.txt"
        seen = report.read_text() if report.exists() else f"ended with exit code {p.exitcode}"
        assert "device-side assert" in seen or p.exitcode != 0, f"rank {rank}: {seen}"
