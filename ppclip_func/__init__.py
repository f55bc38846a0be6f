"""ppclip_func: one pure, compile-friendly global-norm gradient clip over a device mesh.

Pipeline stages × FSDP/HSDP shards × tensor-parallel shards × expert groups:
every leaf is weighed by its layout, all of them are combined locally, and a
single functional all-reduce gives every rank the norm of the whole model.
"""

from ._base.torch_compat import UnsupportedTorchError, UntestedTorchWarning, warn_if_untested
from ._clip.adagc import AdaGCState, AdaGCStats, adagc_clip_grad_norm, adagc_clip_grad_norm_, init_adagc_state
from ._clip.adaptive import ClipState, ClipStats, init_clip_state, select_update, skip_update_
from ._clip.forms import (
    adaptive_clip_grad_norm,
    adaptive_clip_grad_norm_,
    clip_grad_norm,
    clip_grad_norm_,
    clip_grads_with_norm,
    global_grad_norm,
)
from ._clip.optimizer import adaptive_clip_grad_norm_in_optimizer, clip_grad_norm_in_optimizer
from ._clip.per_group import clip_grad_norm_by_group, clip_grad_norm_by_group_
from ._clip.record import ClipRecorder, ParamNormStats, StepRecord
from ._clip.stateful import AdaGCStateful, ClipStateful
from ._clip.step import LocalLoss, StepStats, clip_grad_norm_with_loss, clip_grad_norm_with_loss_
from ._clip.write_back import write_back_
from ._core.param_norms import ParamIndex, param_norm_index

__all__ = [
    # Measure, apply, or both (pure).
    "global_grad_norm",
    "clip_grads_with_norm",
    "clip_grad_norm",
    # In place on p.grad: the drop-in for torchtitan-style trainers.
    "clip_grad_norm_",
    # The step's global mean loss and token count from the same collective, the token normalization folded in.
    "clip_grad_norm_with_loss_",
    "clip_grad_norm_with_loss",
    "LocalLoss",
    "StepStats",
    # A threshold per group; groups kept out of the total and never scaled (Muon's parameters).
    "clip_grad_norm_by_group_",
    "clip_grad_norm_by_group",
    # Handed to the optimizer's next step: fused kernels clip and skip as they read the grads.
    "clip_grad_norm_in_optimizer",
    "adaptive_clip_grad_norm_in_optimizer",
    # A threshold that follows the run, step skipping, per-parameter norms.
    "adaptive_clip_grad_norm_",
    "adaptive_clip_grad_norm",
    "init_clip_state",
    "ClipState",
    "ClipStats",
    "skip_update_",
    "select_update",
    "param_norm_index",
    "ParamIndex",
    # Per-parameter thresholds that follow each parameter's own history (AdaGC).
    "adagc_clip_grad_norm_",
    "adagc_clip_grad_norm",
    "init_adagc_state",
    "AdaGCState",
    "AdaGCStats",
    # The adaptive state in a checkpoint (torch.distributed.checkpoint, torchtitan).
    "ClipStateful",
    "AdaGCStateful",
    # Each step's statistics kept on the device and read later, the parameters behind a spike named.
    "ClipRecorder",
    "StepRecord",
    "ParamNormStats",
    # A step's new state written into the tensors that persist, right inside a compiled or captured step.
    "write_back_",
    # A torch release without an internal the clip needs (raised at its first call); one newer than tested.
    "UnsupportedTorchError",
    "UntestedTorchWarning",
]

warn_if_untested()

__version__ = "0.2.0.dev0"
