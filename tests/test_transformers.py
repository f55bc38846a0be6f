"""The clip in Hugging Face ``transformers.Trainer`` 5.23, through ``use_ppclip``: both its clip paths, on gloo ranks.

Two gloo ranks, started once for every case (``demo/harness.py`` through
``tests/_cases.py``); four for the slow tensor × FSDP2 case. Each case builds
its layout as a user does (``tests/_transformers.py``): a tiny Llama saved
from a config into a temporary folder, loaded with ``from_pretrained`` (with
``DistributedConfig(...)`` for transformers' own tensor parallelism and
FSDP2), a ``Trainer``, ``use_ppclip(trainer)``, ``trainer.train()``. At every
optimizer step a probe (``tests/_transformers.Probe``) takes the step's
gradients and records:

* the float64 reference: the whole model's gradient gathered from every
  rank, its norm taken the obvious way;
* the Trainer's own method on them (``Trainer._clip_grad_norm`` or
  ``_get_grad_norm``: its ``_mixed_mesh_grad_norm`` where DTensors and
  plain tensors mix, else ``accelerator.clip_grad_norm_``), its norm and
  clipped gradients, to float32 precision; then the gradients are put back;
* ours on the same gradients: the norm within 1e-6 relative of float64, the
  clipped gradients the float64 reference scaled by the float64 coefficient
  within 1e-6, and its collectives: one all-reduce where the gradients are
  sharded, none where every rank holds them whole (DDP), from the first call
  on (the first call's one-time agreement gather is not counted:
  ``ppclip_func/_core/agreement.py``).

And the ``grad_norm`` the Trainer logs at each step is ours, exactly. The
adaptive threshold's state goes through the Trainer's own checkpoint and
``resume_from_checkpoint``, bit for bit. Bad options are refused where they
are given, on one process, with nothing changed.

Not run, because it does not run on CPU ranks: pipeline parallelism
(``DistributedConfig(pp_size=2)``; see docs/transformers.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests import _trainer_checks
from tests._cases import real_rank_test
from tests._gather import shared_dir
from tests._trainer_checks import RTOL, all_but

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no download: the model is built from a config
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install transformers==5.23.0"
)

from tests._transformers import (  # noqa: E402
    TRANSFORMERS_VERSION,
    Probe,
    TokenDataset,
    logs_callback,
    tiny_llama,
    training_arguments,
)

TRAINER_RTOL = 1e-5  # the Trainer's own norm and clip are float32
MAX_GRAD_NORM = 0.5  # below every step's norm here: the clip scales
STEPS = 2


def test_transformers_version() -> None:
    """These tests were written against transformers 5.23.0; another version runs them, saying so here."""
    if transformers.__version__ != TRANSFORMERS_VERSION:
        pytest.skip(f"transformers {transformers.__version__} is installed; these tests pin {TRANSFORMERS_VERSION}")


# ---------------------------------------------------------------------------------------------
# One process: options refused where they are given, and nothing changed
# ---------------------------------------------------------------------------------------------

# (use_ppclip's arguments, the error, what the message says)
BAD = {
    "unknown_option": (
        dict(options={"nonfinte": "zero"}),
        TypeError,
        r"use_ppclip\(options=\.\.\.\): 'nonfinte' is not an option of clip_grad_norm_ \(did you mean 'nonfinite'\?\)",
    ),
    "unknown_adaptive_option": (
        dict(adaptive={"zscore_epss": 1.0}),
        TypeError,
        r"use_ppclip\(adaptive=\.\.\.\): 'zscore_epss' is not an option of adaptive_clip_grad_norm_",
    ),
    "max_norm_given_twice": (
        dict(options={"max_norm": 1.0}),
        TypeError,
        r"use_ppclip\(options=\.\.\.\): 'max_norm' is set by TrainingArguments\.max_grad_norm",
    ),
    "adaptive_max_norm_given_twice": (
        dict(adaptive={"max_norm": 1.0}),
        TypeError,
        r"use_ppclip\(adaptive=\.\.\.\): 'max_norm' is set by TrainingArguments\.max_grad_norm",
    ),
    "options_and_adaptive": (
        dict(options={"eps": 1e-6}, adaptive={}),
        TypeError,
        r"use_ppclip\(options=\.\.\.\) and use_ppclip\(adaptive=\.\.\.\) are both given",
    ),
    "groups_set_by_the_trainer": (dict(options={"groups": {"a": "a"}}), TypeError, r"'groups' is set by the Trainer"),
    "wrong_type": (
        dict(options={"norm_type": "two"}),
        TypeError,
        r"use_ppclip\(options=\.\.\.\): norm_type must be a real number",
    ),
    "wrong_type_bool": (
        dict(options={"overflow_safe": 1}),
        TypeError,
        r"use_ppclip\(options=\.\.\.\): overflow_safe must be a bool",
    ),
    "unknown_rule": (
        dict(adaptive={"mode": "nope"}),
        ValueError,
        r"use_ppclip\(adaptive=\.\.\.\): mode must be one of \('zscore', 'percentile'\), got 'nope'",
    ),
    "out_of_range": (
        dict(adaptive={"warmup": 1}),
        ValueError,
        r"use_ppclip\(adaptive=\.\.\.\): warmup must be an int >= 2",
    ),
    "not_a_mapping": (
        dict(options=[("eps", 1e-6)]),
        TypeError,
        r"use_ppclip\(options=\.\.\.\): options must be a mapping",
    ),
}


def _one_process_trainer(cls: type | None = None, **args: Any) -> Any:
    arguments = transformers.TrainingArguments(tempfile.mkdtemp(), use_cpu=True, report_to=[], **args)
    return (cls or transformers.Trainer)(model=torch.nn.Linear(2, 1), args=arguments)


@pytest.mark.parametrize("case", BAD)
def test_use_ppclip_refuses_a_bad_option_and_changes_nothing(case: str) -> None:
    from ppclip_func.transformers import use_ppclip

    kwargs, error, message = BAD[case]
    trainer = _one_process_trainer()
    with pytest.raises(error, match=message):
        use_ppclip(trainer, **kwargs)
    assert type(trainer) is transformers.Trainer and "_ppclip_config" not in vars(trainer)


@pytest.mark.parametrize("case", [c for c in BAD if c not in ("options_and_adaptive",)])
def test_mixin_refuses_a_bad_option_before_the_trainer_is_built(case: str) -> None:
    from ppclip_func.transformers import PPClipMixin

    kwargs, error, message = BAD[case]
    built = []

    class Recording(transformers.Trainer):
        def __init__(self, *args: Any, **kw: Any) -> None:
            built.append(True)
            super().__init__(*args, **kw)

    attrs = {"ppclip_options": kwargs.get("options"), "ppclip_adaptive": kwargs.get("adaptive")}
    cls = type("MyTrainer", (PPClipMixin, Recording), attrs)
    where = message.replace(r"use_ppclip\(options=\.\.\.\)", r"MyTrainer\.ppclip_options").replace(
        r"use_ppclip\(adaptive=\.\.\.\)", r"MyTrainer\.ppclip_adaptive"
    )
    with pytest.raises(error, match=where):
        _one_process_trainer(cls)
    assert not built, "the Trainer was built before its options were checked"


def test_adaptive_needs_a_cap_above_zero() -> None:
    """``max_grad_norm=0`` means the Trainer never calls its clip: the adaptive threshold would never run."""
    from ppclip_func.transformers import use_ppclip

    trainer = _one_process_trainer(max_grad_norm=0.0)
    with pytest.raises(
        ValueError, match=r"use_ppclip: the adaptive threshold needs TrainingArguments\.max_grad_norm > 0"
    ):
        use_ppclip(trainer, adaptive={})
    assert type(trainer) is transformers.Trainer
    use_ppclip(trainer)  # the fixed clip measures the norm only, as the Trainer's does
    assert type(trainer).__name__ == "PPClipTrainer"


@pytest.mark.parametrize("kind", ["DEEPSPEED", "MEGATRON_LM", "XLA"])
def test_refuses_engines_that_clip_themselves(kind: str) -> None:
    from accelerate.utils import DistributedType

    from ppclip_func.transformers import use_ppclip

    accelerator = types.SimpleNamespace(distributed_type=DistributedType(kind), is_fsdp2=False, torch_device_mesh=None)
    trainer = types.SimpleNamespace(accelerator=accelerator, args=types.SimpleNamespace(max_grad_norm=1.0))
    with pytest.raises(ValueError, match=kind):
        use_ppclip(trainer)
    assert type(trainer) is types.SimpleNamespace and not hasattr(trainer, "_ppclip_config")


def test_use_ppclip_twice_and_on_a_subclass() -> None:
    """Converting twice keeps one class; a subclass of the Trainer keeps its own methods and ``isinstance``."""
    from ppclip_func.transformers import PPClipMixin, use_ppclip

    class MyTrainer(transformers.Trainer):
        def mine(self) -> str:
            return "mine"

    trainer = use_ppclip(_one_process_trainer(MyTrainer, max_grad_norm=1.0), options={"norm_type": 1.0})
    cls = type(trainer)
    assert use_ppclip(trainer, adaptive={"warmup": 2}) is trainer and type(trainer) is cls
    assert isinstance(trainer, MyTrainer) and isinstance(trainer, PPClipMixin) and trainer.mine() == "mine"
    trainer.model.weight.grad = torch.tensor([[3.0, -4.0]])
    trainer.model.bias.grad = torch.tensor([0.0])
    norm = trainer._clip_grad_norm(trainer.model)  # adaptive, in warm-up: capped at max_grad_norm
    assert float(norm) == 5.0 and int(trainer.ppclip_state.state.count) == 1


def test_imports_without_transformers() -> None:
    """``ppclip_func.transformers`` imports nothing of transformers until a trainer is clipped."""
    code = "import sys; sys.modules['transformers'] = None; import ppclip_func.transformers; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------------------------------
# On gloo ranks: one Trainer.train() per layout, every step probed
# ---------------------------------------------------------------------------------------------


def _train(
    model_dir: str,
    args: Any,
    *,
    distributed_config: Any = None,
    options: dict[str, Any] | None = None,
    adaptive: dict[str, Any] | None = None,
    resume: str | None = None,
    callbacks: tuple[Any, ...] = (),
) -> tuple[Any, Probe, list[dict[str, float]]]:
    """``Trainer.train()`` after ``use_ppclip``, every clip probed; returns the trainer, the probe and the logs."""
    from ppclip_func.transformers import use_ppclip

    kwargs = {} if distributed_config is None else {"distributed_config": distributed_config}
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, **kwargs)
    logs = logs_callback()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[logs, *callbacks])
    use_ppclip(trainer, options=options, adaptive=adaptive)
    probe = Probe(trainer, (options or adaptive or {}).get("norm_type", 2.0))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, probe, logs.logs


class Checks(_trainer_checks.Checks):
    """The shared checks (``tests/_trainer_checks.py``), and those of every step a probe recorded."""

    def steps(
        self,
        probe: Probe,
        logs: list[dict[str, float]],
        *,
        path: str,
        collectives: int,
        mixed: bool,
        steps: int = STEPS,
    ) -> None:
        """Every probed step: ours vs float64 and the Trainer's own, the clipped grads, collectives, the log."""
        self.that(len(probe.steps) == steps, f"{len(probe.steps)} clips probed, {steps} expected")
        for i, s in enumerate(probe.steps):
            at = f"step {i + 1}"
            self.that(s.path == path, f"{at}: the Trainer's own path is {s.path}, {path} expected")
            types_ = {t for t, _ in s.grad_kinds}
            self.that(mixed == (len(s.grad_kinds) > 1), f"{at}: gradients {s.grad_kinds}, mixed={mixed} expected")
            self.that(types_ <= {"DTensor", "Tensor"}, f"{at}: gradients {s.grad_kinds}")
            self.that(
                type(s.ours) is torch.Tensor and s.ours.dtype == torch.float64 and s.ours.dim() == 0,
                f"{at}: ours returned {type(s.ours).__name__} {s.ours.dtype}, not a 0-dim float64 tensor",
            )
            self.close(f"ours {at}", float(s.ours), s.reference, RTOL)
            self.close(f"trainer {at}", s.theirs, s.reference_p2, TRAINER_RTOL)
            self.error(f"ours-grads {at}", s.ours_grads_error, RTOL)
            self.error(f"trainer-grads {at}", s.theirs_grads_error, TRAINER_RTOL)
            self.that(s.method == "_get_grad_norm" or s.clipped, f"{at}: the clip did not scale")
            self.that(
                s.collectives == collectives, f"{at}: ours issued {s.collectives} collectives, {collectives} expected"
            )
        logged = [entry["grad_norm"] for entry in logs if "grad_norm" in entry]
        ours = [float(s.ours) for s in probe.steps]
        self.that(logged == ours, f"the Trainer logged grad_norm {logged}, ours were {ours}")
        kinds = sorted({k for s in probe.steps for k in s.grad_kinds}, key=str)
        theirs = sorted({s.theirs_collectives for s in probe.steps})
        self.notes.append(f"grads {kinds}; Trainer's path {path} {theirs} collective(s); ours {collectives}")


def ddp__grad_accumulation(rank: int, world_size: int) -> None:
    """DDP (Accelerate's, ``MULTI_CPU``) with 2 micro-batches per step: every rank holds the whole gradient."""
    checks = Checks("ddp__grad_accumulation")
    with tiny_llama() as path, shared_dir("ppclip_tf_out_") as out:
        args = training_arguments(out, max_steps=STEPS, gradient_accumulation_steps=2, max_grad_norm=MAX_GRAD_NORM)
        trainer, probe, logs = _train(path, args)
        checks.that(type(trainer.model_wrapped).__name__ == "DistributedDataParallel", "the model is not DDP")
        checks.steps(probe, logs, path="accelerator.clip_grad_norm_", collectives=0, mixed=False)
    checks.done()


def ddp__no_clip(rank: int, world_size: int) -> None:
    """``max_grad_norm=0``: the Trainer only measures, in ``_get_grad_norm``; that norm is ours and logged."""
    checks = Checks("ddp__no_clip")
    with tiny_llama() as path, shared_dir("ppclip_tf_out_") as out:
        args = training_arguments(out, max_steps=STEPS, max_grad_norm=0.0)
        _, probe, logs = _train(path, args)
        checks.that(all(s.method == "_get_grad_norm" for s in probe.steps), "a step clipped with max_grad_norm=0")
        checks.steps(probe, logs, path="accelerator.clip_grad_norm_", collectives=0, mixed=False)
    checks.done()


def tp2__distributed_config(rank: int, world_size: int) -> None:
    """``DistributedConfig(tp_size=2)``: DTensor and plain gradients mix; the Trainer's ``_mixed_mesh_grad_norm``."""
    from transformers.distributed import DistributedConfig

    checks = Checks("tp2__distributed_config")
    with tiny_llama() as path, shared_dir("ppclip_tf_out_") as out:
        args = training_arguments(out, cpu_as_gpu=True, max_steps=STEPS, max_grad_norm=MAX_GRAD_NORM)
        _, probe, logs = _train(path, args, distributed_config=DistributedConfig(tp_size=2))
        checks.steps(probe, logs, path="_mixed_mesh_grad_norm", collectives=1, mixed=True)
        kinds = probe.steps[0].grad_kinds
        checks.that(kinds == {("DTensor", ("tp",)), ("Tensor", None)}, f"gradients {kinds}")
        # A model sharded at load time cannot be checkpointed for resuming: the Trainer refuses it.
        try:
            model = transformers.LlamaForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2))
            transformers.Trainer(model=model, args=training_arguments(out, cpu_as_gpu=True, save_strategy="steps"))
            checks.failures.append("the Trainer accepted save_strategy='steps' for a DistributedConfig model")
        except ValueError as e:
            checks.that("Resuming is not supported for models sharded at load time" in str(e), str(e))
    checks.done()


def fsdp2__distributed_config(rank: int, world_size: int) -> None:
    """``DistributedConfig(fsdp_size=2)``, 2 micro-batches per step, ``norm_type=1`` given to ``use_ppclip``."""
    from transformers.distributed import DistributedConfig

    checks = Checks("fsdp2__distributed_config")
    with tiny_llama() as path, shared_dir("ppclip_tf_out_") as out:
        args = training_arguments(out, max_steps=STEPS, gradient_accumulation_steps=2, max_grad_norm=MAX_GRAD_NORM)
        _, probe, logs = _train(
            path, args, distributed_config=DistributedConfig(fsdp_size=2), options={"norm_type": 1.0}
        )
        checks.steps(probe, logs, path="accelerator.clip_grad_norm_", collectives=1, mixed=False)
        kinds = probe.steps[0].grad_kinds
        checks.that(kinds == {("DTensor", ("fsdp",))}, f"gradients {kinds}")
        checks.that(all(s.reference != s.reference_p2 for s in probe.steps), "the norm type was not ours")
    checks.done()


def fsdp2__accelerate(rank: int, world_size: int) -> None:
    """FSDP2 through Accelerate (``TrainingArguments(fsdp=..., fsdp_config={"fsdp_version": 2})``)."""
    checks = Checks("fsdp2__accelerate")
    with tiny_llama() as path, shared_dir("ppclip_tf_out_") as out:
        args = training_arguments(
            out,
            cpu_as_gpu=True,
            max_steps=STEPS,
            max_grad_norm=MAX_GRAD_NORM,
            fsdp="full_shard",
            fsdp_config={"fsdp_version": 2},
        )
        trainer, probe, logs = _train(path, args)
        checks.that(str(trainer.accelerator.distributed_type) == "DistributedType.FSDP", "not Accelerate's FSDP")
        checks.that(trainer.accelerator.is_fsdp2, "not FSDP2")
        checks.steps(probe, logs, path="accelerator.clip_grad_norm_", collectives=1, mixed=False)
    checks.done()


def ddp__adaptive_checkpoint_resume(rank: int, world_size: int) -> None:
    """The adaptive state in the Trainer's checkpoint, and ``resume_from_checkpoint``, bit for bit."""
    from transformers import TrainerCallback

    from ppclip_func.transformers import STATE_NAME

    checks = Checks("ddp__adaptive_checkpoint_resume")
    adaptive = {"warmup": 2, "z": 2.5}
    holder: dict[str, Any] = {}

    def state() -> list[torch.Tensor]:
        return [t.detach().clone() for t in holder["trainer"].ppclip_state.state]

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.saved: list[list[torch.Tensor]] = []
            self.begin: list[torch.Tensor] | None = None

        def on_save(self, *args: Any, **kwargs: Any) -> None:
            self.saved.append(state())

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.begin = state()

    def run(out: str, resume: str | None) -> tuple[Probe, Record, list[torch.Tensor]]:
        record = Record()
        args = training_arguments(out, max_steps=4, max_grad_norm=1.0, save_strategy="steps", save_steps=2)
        model = transformers.LlamaForCausalLM.from_pretrained(path)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[record])
        from ppclip_func.transformers import use_ppclip

        holder["trainer"] = use_ppclip(trainer, adaptive=adaptive)
        probe = Probe(trainer)
        trainer.train(resume_from_checkpoint=resume)
        return probe, record, state()

    def bits(ts: list[torch.Tensor]) -> list[tuple[str, bytes]]:
        return [(str(t.dtype), t.cpu().numpy().tobytes()) for t in ts]

    with tiny_llama() as path, shared_dir("ppclip_tf_out_") as out:
        full, record, end = run(out, None)
        checkpoint = os.path.join(out, "checkpoint-2")
        on_disk = torch.load(os.path.join(checkpoint, STATE_NAME), weights_only=True)
        checks.that(int(on_disk["count"]) == 2, f"checkpoint-2 holds {on_disk}")
        checks.that(bits(list(on_disk.values())) == bits(record.saved[0]), "the saved state is not the state at step 2")
        resumed, record_b, end_b = run(out, checkpoint)
        checks.that(
            record_b.begin is not None and bits(record_b.begin) == bits(record.saved[0]), "resume: not bit for bit"
        )
        checks.that(bits(end_b) == bits(end), f"after resuming, the state is {end_b}, not {end}")
        ours_full = [float(s.ours) for s in full.steps[2:]]
        ours_resumed = [float(s.ours) for s in resumed.steps]
        checks.that(ours_full == ours_resumed, f"steps 3-4: norms {ours_resumed} resumed, {ours_full} uninterrupted")
        checks.that(len(full.steps) == 4 and len(resumed.steps) == 2, "steps run")
        for i, s in enumerate(full.steps):
            checks.close(f"ours step {i + 1}", float(s.ours), s.reference, RTOL)
        checks.notes.append(f"state at step 2 {[float(t) for t in record.saved[0]]}, at 4 {[float(t) for t in end]}")
    checks.done()


def tp2_fsdp2__distributed_config(rank: int, world_size: int) -> None:
    """``DistributedConfig(tp_size=2, fsdp_size=2)`` on 4 ranks: DTensors on two meshes, no plain gradient."""
    from transformers.distributed import DistributedConfig

    checks = Checks("tp2_fsdp2__distributed_config")
    with tiny_llama() as path, shared_dir("ppclip_tf_out_") as out:
        args = training_arguments(out, cpu_as_gpu=True, max_steps=STEPS, max_grad_norm=MAX_GRAD_NORM)
        _, probe, logs = _train(path, args, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))
        checks.steps(probe, logs, path="_mixed_mesh_grad_norm", collectives=1, mixed=True)
        kinds = probe.steps[0].grad_kinds
        checks.that(kinds == {("DTensor", ("fsdp", "tp")), ("DTensor", ("fsdp",))}, f"gradients {kinds}")
    checks.done()


CASES: list[Callable[[int, int], None]] = [
    ddp__grad_accumulation,
    ddp__no_clip,
    tp2__distributed_config,
    fsdp2__distributed_config,
    fsdp2__accelerate,
    ddp__adaptive_checkpoint_resume,
]

# make test-quick runs one case alone on the ranks (about 5 s); the others are slow.
test_on_2_ranks = real_rank_test(CASES, 2, case_timeout=60.0, slow=all_but(CASES, "fsdp2__distributed_config"))
test_on_4_ranks = pytest.mark.slow(real_rank_test([tp2_fsdp2__distributed_config], 4, case_timeout=90.0))
