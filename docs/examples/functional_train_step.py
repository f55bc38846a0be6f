"""A whole training step as one compiled graph: gradients, the clip's one all-reduce, AdamW, the skip.

The step maps ``(params, opt_state, clip_state, batch)`` to new ones with nothing outside it (no
``loss.backward()``, no ``optimizer.step()``), so ``torch.compile(fullgraph=True)`` traces one graph
(tests/test_functional_train_step.py). On one CPU process: ``python docs/examples/functional_train_step.py``.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.func import functional_call, grad_and_value
from torch.optim.adamw import adamw

from ppclip_func import adaptive_clip_grad_norm, init_clip_state, select_update

ADAMW = {"lr": 3e-2, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.1, "eps": 1e-8}
CLIP = {"max_norm": 5.0, "warmup": 5}  # ZClip's threshold after 5 steps, never above 5.0


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def init_state(model):
    # float64 step counts: capturable AdamW computes its bias corrections in their dtype.
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {k: {n: torch.zeros_like(p) for n, p in params.items()} for k in ("exp_avg", "exp_avg_sq")}
    steps = {n: torch.zeros((), dtype=torch.float64, device=p.device) for n, p in params.items()}
    return params, {**moments, "step": steps}, init_clip_state(next(model.parameters()).device)


def make_train_step(model, mesh):
    def loss_fn(params, x, y):
        return torch.nn.functional.mse_loss(functional_call(model, params, (x,)), y)

    def train_step(params, opt_state, clip_state, x, y):
        grads, loss = grad_and_value(loss_fn)(params, x, y)
        grads, stats = adaptive_clip_grad_norm(grads, mesh, clip_state, **CLIP)  # the one all-reduce
        new_params = {n: p.clone() for n, p in params.items()}
        new_state = {k: {n: t.clone() for n, t in v.items()} for k, v in opt_state.items()}
        adamw(  # lists in one order: every dict here is keyed by the parameter names, in params' order
            list(new_params.values()),
            list(grads.values()),
            list(new_state["exp_avg"].values()),
            list(new_state["exp_avg_sq"].values()),
            [],  # max_exp_avg_sqs: amsgrad is off
            list(new_state["step"].values()),
            foreach=True,
            capturable=True,  # the step counts stay tensors: nothing is read on the host
            amsgrad=False,
            maximize=False,
            **ADAMW,
        )
        # Where stats.skip (a non-finite norm), the old parameters and moments; stats.state is then the old one.
        params, opt_state = select_update(stats.skip, (new_params, new_state), (params, opt_state))
        return params, opt_state, stats.state, loss, stats

    return train_step


def batches(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(8, 4, generator=g)
    xs = [torch.randn(32, 8, generator=g) for _ in range(steps)]
    return [(x, x @ w) for x in xs]


def main(steps=20):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        model = make_model()
        params, opt_state, clip_state = init_state(model)
        step = torch.compile(make_train_step(model, mesh), fullgraph=True)
        for i, (x, y) in enumerate(batches(steps)):
            params, opt_state, clip_state, loss, stats = step(params, opt_state, clip_state, x, y)
            print(f"step {i:2d}  loss {loss.item():.4f}  norm {stats.total_norm.item():.4f}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
