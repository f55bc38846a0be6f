"""ppclip_func: one pure, compile-friendly global-norm gradient clip over a device mesh.

Pipeline stages × FSDP/HSDP shards × tensor-parallel shards × expert groups:
every leaf is weighed by its layout, all of them are combined locally, and a
single functional all-reduce gives every rank the norm of the whole model.
"""

from ._api import clip_grad_norm, clip_grad_norm_, clip_grads_with_norm, global_grad_norm

__all__ = [
    # Measure, apply, or both (pure).
    "global_grad_norm",
    "clip_grads_with_norm",
    "clip_grad_norm",
    # In place on p.grad: the drop-in for torchtitan-style trainers.
    "clip_grad_norm_",
]

__version__ = "0.2.0.dev0"
