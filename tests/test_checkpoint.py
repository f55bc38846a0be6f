"""The adaptive state survives a restart: a resumed run is the run that never stopped, bit for bit.

A run of ``STEPS`` adaptive clips (drifting norms, a clipped spike, a skipped
one, a NaN) against the same run stopped at ``STOP``, its :class:`ClipStateful`
saved with ``dcp.save``, a fresh one loaded with ``dcp.load``, and resumed:
every threshold, z-score, skip decision and state after the restart has the
same bits as in the run that went through. A resume from a fresh state
instead must differ, so the comparison can fail.

* one process: stopped in warm-up and after it; and once through torchtitan's
  own ``CheckpointManager`` (a tiny ``nn.Linear`` with torchtitan's
  ``OptimizersContainer`` and ``LRSchedulersContainer``, the clip in its
  ``states``), saved by one manager and loaded by a new one;
* real gloo ranks, one start of 4 for every case (``demo/harness.py``): the
  gradient ``Shard(0)``-sharded over a 4-rank mesh, the state identical on
  every rank, saved by all 4 and loaded by all 4; and saved by 4 and loaded
  by 2 (a process group of ranks 0 and 1) that resume on a 2-rank mesh.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ppclip_func import ClipState, ClipStateful, adaptive_clip_grad_norm, init_clip_state
from tests._cases import real_rank_test
from tests._gather import shared_dir
from tests._torchtitan import needs_torchtitan

STEPS, STOP = 80, 40
OPTS = dict(max_norm=None, warmup=10, skip_z=8.0)
EVENTS = {30: 2.0, 45: 50.0, 55: math.nan, 60: 2.0}  # a clipped spike, a skipped one, a NaN, a clipped one

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _full_grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    scale = (1 + 0.2 * math.sin(step / 5)) * EVENTS.get(step, 1.0)
    return {"w": torch.randn(16, 6, generator=g) * scale, "b": torch.randn(16, generator=g) * scale}


def _grads(step: int, mesh: DeviceMesh | None) -> dict[str, torch.Tensor]:
    full = _full_grads(step)
    if mesh is None:
        return full
    rank, size = mesh.get_local_rank(), mesh.size()
    return {
        k: DTensor.from_local(
            v.chunk(size)[rank].contiguous(), mesh, [Shard(0)], run_check=False, shape=v.shape, stride=v.stride()
        )
        for k, v in full.items()
    }


Record = tuple[torch.Tensor, ...]


def _steps(state: ClipState, first: int, last: int, mesh: DeviceMesh | None = None) -> tuple[list[Record], ClipState]:
    """Runs steps ``first`` to ``last - 1``; returns what each measured and decided, and the state after."""
    records = []
    for step in range(first, last):
        _, stats = adaptive_clip_grad_norm(_grads(step, mesh), mesh, state, **OPTS)
        state = stats.state
        records.append((stats.total_norm, stats.threshold, stats.zscore, stats.skip, *state))
    return records, state


def _bits(t: torch.Tensor) -> tuple[torch.dtype, bytes]:
    return t.dtype, t.detach().cpu().reshape(1).view(torch.uint8).numpy().tobytes()


def _same_bits(got: list[Record], want: list[Record]) -> bool:
    return len(got) == len(want) and all(
        _bits(a) == _bits(b) for g, w in zip(got, want) for a, b in zip(g, w, strict=True)
    )


def _assert_the_run_tests_something(full: list[Record]) -> None:
    after = full[STOP:]
    skips = [bool(r[3]) for r in after]
    clipped = [float(r[1]) < float(r[0]) for r in after if not bool(r[3])]
    assert any(skips) and not all(skips), "skipped and applied steps after the restart"
    assert any(clipped), "a spike clipped after the restart"


# --- one process -----------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [5, STOP], ids=["in_warmup", "after_warmup"])
def test_a_run_resumed_from_dcp_is_the_run_that_never_stopped(tmp_path, stop):
    full, _ = _steps(init_clip_state(), 0, STEPS)
    _assert_the_run_tests_something(full)

    clip = ClipStateful()
    before, clip.state = _steps(clip.state, 0, stop)
    dcp.save({"clip": clip}, checkpoint_id=tmp_path)
    resumed = ClipStateful()
    dcp.load({"clip": resumed}, checkpoint_id=tmp_path)
    assert _same_bits([tuple(resumed.state)], [tuple(clip.state)])
    after, _ = _steps(resumed.state, stop, STEPS)
    assert _same_bits(before + after, full)

    from_scratch, _ = _steps(init_clip_state(), stop, STEPS)
    assert not _same_bits(before + from_scratch, full), "a lost state would be seen"


def test_state_dict_is_copies_and_load_restores_onto_the_holders_device_and_dtype():
    clip = ClipStateful()
    _, clip.state = _steps(clip.state, 0, 12)
    saved = clip.state_dict()
    assert list(saved) == ["count", "mean", "var"] and all(type(t) is torch.Tensor for t in saved.values())
    saved["mean"].add_(1.0)
    assert not torch.equal(clip.state.mean, saved["mean"]), "the holder's state is not the dict's tensor"

    fp32 = ClipStateful(dtype=torch.float32)
    fp32.load_state_dict(clip.state_dict())
    assert fp32.state.mean.dtype == torch.float32 and fp32.state.count.dtype == torch.int64
    assert float(fp32.state.mean) == pytest.approx(float(clip.state.mean), rel=1e-7)
    assert int(fp32.state.count) == 12


@pytest.mark.parametrize(
    "bad, error, match",
    [
        ([1, 2, 3], TypeError, "mapping"),
        ({"count": torch.tensor(1), "mean": torch.tensor(1.0)}, ValueError, "keys"),
        ({"count": torch.tensor(1), "mean": 1.0, "var": torch.tensor(0.0)}, TypeError, "mean"),
        ({"count": torch.tensor(1), "mean": torch.ones(2), "var": torch.tensor(0.0)}, ValueError, "0-dim"),
    ],
)
def test_a_malformed_state_dict_raises_and_leaves_the_state(bad, error, match):
    clip = ClipStateful()
    with pytest.raises(error, match=match):
        clip.load_state_dict(bad)
    assert _same_bits([tuple(clip.state)], [tuple(init_clip_state())])
    with pytest.raises(TypeError, match="ClipState"):
        clip.state = (torch.tensor(0), torch.tensor(0.0), torch.tensor(0.0))


def _torchtitan_manager(folder: str, clip: ClipStateful):
    """torchtitan's CheckpointManager for a tiny model and torchtitan's own optimizer and LR containers."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, default_adamw

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 16)
    optimizer_config = default_adamw(lr=1e-3)
    optimizer_config.implementation = "for-loop"  # "fused" (the default) is for GPUs
    optimizers = OptimizersContainer(optimizer_config, model_parts=[model])
    lr_schedulers = LRSchedulersContainer(optimizers, lambda step: 1.0)
    config = CheckpointManager.Config(enable=True, folder="checkpoint", interval=STOP, keep_latest_k=0)
    return CheckpointManager(
        config,
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"clip": clip},
        sd_adapter=None,
        base_folder=folder,
    )


@needs_torchtitan
def test_torchtitans_checkpoint_manager_saves_and_restores_the_state(tmp_path):
    full, _ = _steps(init_clip_state(), 0, STEPS)

    clip = ClipStateful()
    manager = _torchtitan_manager(str(tmp_path), clip)
    try:
        before, clip.state = _steps(clip.state, 0, STOP)
        assert manager.save(curr_step=STOP)
    finally:
        manager.close()
    assert (tmp_path / "checkpoint" / f"step-{STOP}").is_dir()

    resumed = ClipStateful()
    manager = _torchtitan_manager(str(tmp_path), resumed)
    try:
        assert manager.load(), "the manager found the checkpoint"
    finally:
        manager.close()
    after, _ = _steps(resumed.state, STOP, STEPS)
    assert _same_bits(before + after, full)


# --- real ranks (one start of 4 for every case) ----------------------------------------------------


def _save_at_stop(folder: str, mesh: DeviceMesh) -> tuple[list[Record], list[Record], ClipState]:
    """On every rank of ``mesh``: the whole run, and the run to STOP with its state saved by dcp."""
    full, _ = _steps(init_clip_state(), 0, STEPS, mesh)
    clip = ClipStateful()
    before, clip.state = _steps(clip.state, 0, STOP, mesh)
    # Replicated: every rank holds the same bits, so whichever copy DCP writes is everyone's.
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [_bits(t) for t in clip.state])
    assert all(e == everyone[0] for e in everyone), "the state differs across ranks"
    dcp.save({"clip": clip}, checkpoint_id=folder)
    return full, before, clip.state


def saved_and_resumed_on_4_ranks(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    with shared_dir("ppclip-checkpoint-") as folder:
        full, before, _ = _save_at_stop(folder, mesh)
        _assert_the_run_tests_something(full)
        metadata = dcp.FileSystemReader(folder).read_metadata()
        for key in ("clip.count", "clip.mean", "clip.var"):
            chunks = metadata.state_dict_metadata[key].chunks
            assert len(chunks) == 1 and list(chunks[0].sizes) == [], f"{key} is saved once, whole: {chunks}"
        resumed = ClipStateful()
        dcp.load({"clip": resumed}, checkpoint_id=folder)
        after, _ = _steps(resumed.state, STOP, STEPS, mesh)
        assert _same_bits(before + after, full)


def saved_on_4_ranks_resumed_on_2(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    with shared_dir("ppclip-checkpoint-") as folder:
        full, _, saved = _save_at_stop(folder, mesh)
        pair = dist.new_group([0, 1])  # every rank creates it; ranks 0 and 1 are the smaller job
        if rank < 2:
            resumed = ClipStateful()
            dcp.load({"clip": resumed}, checkpoint_id=folder, process_group=pair)
            assert _same_bits([tuple(resumed.state)], [tuple(saved)])
            two = DeviceMesh.from_group(pair, "cpu", mesh_dim_names=("dp",))
            after, _ = _steps(resumed.state, STOP, STEPS, two)
            unbroken, _ = _steps(saved, STOP, STEPS, two)  # the state never left memory, same 2-rank layout
            assert _same_bits(after, unbroken)
            # Against the 4-rank run: the same decisions; norms summed over 2 shards instead of 4 round apart.
            assert [bool(r[3]) for r in after] == [bool(r[3]) for r in full[STOP:]]
            for got, want in zip(after, full[STOP:]):
                torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0, equal_nan=True)


CASES = [saved_and_resumed_on_4_ranks, saved_on_4_ranks_resumed_on_2]
test_on_real_ranks = real_rank_test(CASES, 4, case_timeout=60.0, share=True)
