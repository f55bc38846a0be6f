"""What inductor generates for a clip compiled with the optimizer step that follows it.

Inductor fuses the clip's multiply into the optimizer's kernels, which read
each gradient more than once (AdamW: both moments). A coefficient or a skip
decision left as inline arithmetic is then recomputed, on CPU, for every
vector of every leaf, once per read: before the clip's results were made
buffers of their own (``_core.scale.own_buffer``), a 4-layer GPT-2 step with
AdamW took 1.3x the step with torch's clip. The decode of the norm takes a
square root; counted in the generated C++, the clip must add a fixed number
of them to the step's own, however many leaves there are, and the compiled
step must still compute what eager does.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.optim.adamw import adamw

from ppclip_func import adaptive_clip_grad_norm_, clip_grad_norm_, init_clip_state, skip_update_

# A leaf of each compiled path: two of the shard band (row-wise norms in the graph: rows that tile it; rows and a
# partial row), two for the one op (whole in its foreach call); three times.
SIZES = [1 << 17, 40000, 4096, 256] * 3


def make_run(variant: str):
    """Parameters with grads, AdamW state, and the step to compile: AdamW after the ``variant`` clip."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in SIZES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    steps = [torch.zeros((), dtype=torch.float64) for _ in params]
    state = init_clip_state()

    @torch.no_grad()
    def adamw_step() -> None:
        # capturable: the step count stays a tensor in the graph (torch allows it eagerly on accelerators only).
        adamw(
            params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps, foreach=True,
            capturable=torch.compiler.is_compiling(), amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-3,
            weight_decay=0.0, eps=1e-8, maximize=False,
        )  # fmt: skip

    @torch.no_grad()
    def run() -> None:
        if variant == "plain":
            clip_grad_norm_(params, None, 1.0)
        elif variant == "nonfinite_zero":
            clip_grad_norm_(params, None, 1.0, nonfinite="zero")
        if variant == "adaptive_skip":
            stats = adaptive_clip_grad_norm_(params, None, state, max_norm=1.0)
            skip_update_(stats.skip, [*params, *exp_avgs, *exp_avg_sqs, *steps], adamw_step)
        else:
            adamw_step()

    return run, params


def compiled_sqrts(variant: str) -> int:
    """Square roots in the C++ that inductor generates for the step; checks it computes what eager does."""
    torch._dynamo.reset()
    run, params = make_run(variant)
    _, code = run_and_get_code(torch.compile(run, fullgraph=True))
    eager_run, eager_params = make_run(variant)
    eager_run()
    for got, want in zip(params, eager_params):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-6, atol=1e-7)
    torch._dynamo.reset()
    return "\n".join(code).count("std::sqrt")


@pytest.fixture(scope="module")
def step_alone() -> int:
    return compiled_sqrts("step")


@pytest.mark.parametrize("variant", ["plain", "nonfinite_zero", "adaptive_skip"])
def test_the_clip_is_computed_once_not_in_every_leafs_update(variant, step_alone):
    added = compiled_sqrts(variant) - step_alone
    assert step_alone >= len(SIZES), "AdamW's own bias correction: one square root per leaf"
    assert 1 <= added < len(SIZES), (
        f"the {variant} clip adds {added} square roots for {len(SIZES)} leaves: its arithmetic is inlined "
        "into the optimizer's per-leaf kernels"
    )
