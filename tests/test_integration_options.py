"""Every trainer integration checks its options where they are given, through one path.

Spec: an unknown key, a key the integration sets itself, a value of the
wrong type or range, an unknown rule: each raises at setup (the call that
patches, the class that declares the options), naming where it was given and
the option, and leaves nothing patched. The check is
``ppclip_func._trainers.options.check_options``, whose option names come from the
public form's own signature: a test below holds it to that.
(Lightning's mixins: tests/test_lightning_packages.py; transformers:
tests/test_transformers.py.)
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from ppclip_func import adaptive_clip_grad_norm_, clip_grad_norm_
from ppclip_func._trainers.options import check_options

# (options, error, a part of the message), for the adaptive form.
BAD_ADAPTIVE = [
    ({"zscore_epss": 1.0}, TypeError, "'zscore_epss' is not an option of adaptive_clip_grad_norm_ (did you mean"),
    ({"alpha": 1.5}, ValueError, "alpha must be a number in (0, 1), got 1.5"),
    ({"warmup": 1}, ValueError, "warmup must be an int >= 2"),
    ({"warmup": "25"}, ValueError, "warmup must be an int >= 2"),
    ({"z": "high"}, ValueError, "z must be a number > 0 or None"),
    ({"mode": "median"}, ValueError, "mode must be one of"),
    ({"clip_option": "max"}, ValueError, "clip_option must be one of"),
    ({"nonfinite": "skip"}, ValueError, "nonfinite must be one of"),
    ({"partial": "sum"}, ValueError, "partial must be one of"),
    ({"overflow_safe": 1}, TypeError, "overflow_safe must be a bool"),
    ({"exclude": ["muon"]}, ValueError, "exclude names 'muon', which is not a label of groups"),
    ({"tied": {"embed": 0}}, ValueError, "tied['embed'] must be the number of stages"),
    ({"pp_dim": 0}, TypeError, "pp_dim must be a mesh dim name"),
    ({1: 2.0}, TypeError, "option names must be strings"),
]


@pytest.mark.parametrize(("options", "error", "message"), BAD_ADAPTIVE)
def test_check_options_names_the_option(options: dict[Any, Any], error: type, message: str) -> None:
    with pytest.raises(error) as raised:
        check_options(adaptive_clip_grad_norm_, options, where="here")
    assert str(raised.value).startswith("here: ") and message in str(raised.value), str(raised.value)


def test_check_options_accepts_every_option_of_the_form_at_its_default() -> None:
    """The names are the form's own: each option at its own default passes, and a copy is returned."""
    for form in (clip_grad_norm_, adaptive_clip_grad_norm_):
        defaults = {
            name: p.default
            for name, p in inspect.signature(form).parameters.items()
            if p.default is not inspect.Parameter.empty
        }
        assert len(defaults) >= 9
        got = check_options(form, defaults, where="here")
        assert got == defaults and got is not defaults


def test_a_value_the_integration_sets_is_refused() -> None:
    with pytest.raises(TypeError, match=r"^here: 'max_norm' is set by the trainer; leave it out of the options$"):
        check_options(adaptive_clip_grad_norm_, {"max_norm": 2.0}, where="here", fixed={"max_norm": "the trainer"})


# ---------------------------------------------------------------------------------------------
# OLMo-core: use_ppclip(adaptive=...) and PPClipMixin.ppclip_adaptive
# ---------------------------------------------------------------------------------------------


class _TrainModule:
    """Stands in for OLMo-core's train module where only the option check is under test (real ones:
    tests/test_olmo_core.py)."""

    world_mesh = None

    def __init__(self) -> None:
        self.model = torch.nn.Linear(2, 1, bias=False)


OLMO_BAD = [
    ({"max_norm": 5.0}, TypeError, "'max_norm' is set by the train module's max_grad_norm"),
    ({"norm_type": 1.0}, TypeError, "'norm_type' is set by OLMo-core's _clip_grad_norm"),
    *BAD_ADAPTIVE[:3],
]


@pytest.mark.parametrize(("options", "error", "message"), OLMO_BAD)
def test_olmo_core_use_ppclip_refuses_at_setup(options: dict[str, Any], error: type, message: str) -> None:
    from ppclip_func.olmo_core import use_ppclip

    module = _TrainModule()
    with pytest.raises(error) as raised:
        use_ppclip(module, adaptive=options)
    assert str(raised.value).startswith("use_ppclip(adaptive=...): ") and message in str(raised.value)
    assert type(module) is _TrainModule and "ppclip_adaptive" not in vars(module)  # nothing patched


@pytest.mark.parametrize(("options", "error", "message"), OLMO_BAD)
def test_olmo_core_mixin_refuses_at_class_definition(options: dict[str, Any], error: type, message: str) -> None:
    from ppclip_func.olmo_core import PPClipMixin

    with pytest.raises(error) as raised:

        class MyTrainModule(PPClipMixin, _TrainModule):
            ppclip_adaptive = options

    assert str(raised.value).startswith("class MyTrainModule.ppclip_adaptive: ") and message in str(raised.value)


def test_olmo_core_good_options_are_kept() -> None:
    from ppclip_func.olmo_core import use_ppclip

    options = {"z": 3.0, "warmup": 2}
    module = use_ppclip(_TrainModule(), adaptive=options)
    assert module.ppclip_adaptive == options and module.ppclip_adaptive is not options
    module.model.weight.grad = torch.tensor([[3.0, 4.0]])
    assert float(module._clip_grad_norm(1.0)) == 5.0


# ---------------------------------------------------------------------------------------------
# Accelerate: patch_accelerator(eps=..., nonfinite=...)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"nonfinite": "bogus"}, ValueError, "patch_accelerator: nonfinite must be one of"),
        ({"eps": -1.0}, ValueError, "patch_accelerator: eps must be a number >= 0"),
        ({"eps": "small"}, ValueError, "patch_accelerator: eps must be a number >= 0"),
    ],
)
def test_accelerate_patch_refuses_at_setup(kwargs: dict[str, Any], error: type, message: str) -> None:
    accelerate = pytest.importorskip("accelerate")
    from ppclip_func.accelerate import patch_accelerator

    accelerator = accelerate.Accelerator(cpu=True)
    with pytest.raises(error, match=message.replace("(", r"\(")):
        patch_accelerator(accelerator, **kwargs)
    assert "clip_grad_norm_" not in vars(accelerator)  # Accelerate's own clip is still the one called
