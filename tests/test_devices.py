"""Where the one collective runs when the grads live elsewhere than the mesh (FSDP2 CPU offload).

torch's own clip reduces CPU-offloaded grads on the CPU over a CUDA mesh and
fails (pytorch#148532). No GPU is lent to CI, so the choice of device is
checked here as a unit, with the meta device standing in for "another
device than the mesh's"; the GPU study (``bench/gpu_study.py``) runs the
offloaded case on a real GPU when one is lent.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from ppclip_func._core.collective import collective_device, mesh_device
from tests._fake_pg import fake_world


def test_statistics_of_grads_on_another_device_are_reduced_on_the_mesh_device():
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        assert collective_device(mesh, torch.device("meta")) == torch.device("cpu")
        assert collective_device(mesh, torch.device("cpu")) == torch.device("cpu")
        assert mesh_device(mesh) == torch.device("cpu")


def test_without_a_mesh_the_statistics_stay_where_the_grads_are():
    assert collective_device(None, torch.device("meta")) == torch.device("meta")


def offloaded_clip_reduces_on_the_gpu() -> tuple[list[str], float]:
    """CPU grads, a CUDA mesh of 4 fake ranks: returns the devices the collective saw, and the norm.

    Run by the test below and by the GPU study (``bench/gpu_study.py``) when CUDA is there.
    """
    from ppclip_func import clip_grad_norm_
    from tests._collectives import CollectiveCounter

    with fake_world(4):
        mesh = init_device_mesh("cuda", (4,), mesh_dim_names=("dp",))
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.full((4,), 2.0)  # on the host, as FSDP2's CPU offload keeps it
        with CollectiveCounter() as counter:
            total = clip_grad_norm_([p], mesh, 1.0)
        assert total.device.type == "cpu" and p.grad.device.type == "cpu"
        return counter.devices, float(total)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the CPU-offload case reduces on CUDA")
def test_cpu_offloaded_grads_over_a_cuda_mesh():
    devices, total = offloaded_clip_reduces_on_the_gpu()
    assert [d.split(":")[0] for d in devices] == ["cuda"]
    assert total == pytest.approx(2.0)  # replicated over 4 fake ranks, each returning its own input
