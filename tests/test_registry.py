"""Methods are registered by their drafter modules: a new drafter is a new file, methods.py is not edited."""

from dataclasses import dataclass

import pytest

from hierspec.drafters import NoDrafter
from hierspec.drafters import registry
from hierspec.errors import InputError
from hierspec.methods import MethodSpec, make_drafter, methods
from tiny import make_target


def test_every_builtin_method_is_registered_by_its_module():
    found = methods()
    assert set(found) == {"ar", "pld", "rest", "hd", "dense", "sd", "hsddw"}
    assert found["hd"].build.__module__ == "hierspec.drafters.hierarchy"
    assert found["pld"].options.__name__ == "PromptLookupConfig" and found["ar"].options is None
    assert all(m.summary for m in found.values())


@dataclass(frozen=True)
class ToyOptions:
    depth: int = 2
    greedy: bool = False


class ToyDrafter(NoDrafter):
    def __init__(self, options: ToyOptions, target) -> None:
        self.options, self.target = options, target


def test_a_drafter_registered_elsewhere_is_built_by_name_with_typed_options():
    registry.register("toy", ToyOptions, summary="a test method")(
        lambda options, written, context: ToyDrafter(options, context.target))
    try:
        target = make_target("llama", vocab_size=32)
        drafter = make_drafter("toy:depth=5,greedy=yes", target).inner  # drafting cost-aware by default
        assert isinstance(drafter, ToyDrafter) and drafter.target is target
        assert isinstance(make_drafter("toy:budget=off", target), ToyDrafter)
        assert drafter.options == ToyOptions(depth=5, greedy=True)
        assert MethodSpec.parse("toy").label == "toy"
        with pytest.raises(InputError, match="no option 'width'"):
            make_drafter("toy:width=1", target)
        with pytest.raises(InputError, match="depth"):
            make_drafter("toy:depth=x", target)
        with pytest.raises(ValueError, match="twice"):
            registry.register("toy")(lambda *args: None)
    finally:
        registry._REGISTERED.pop("toy", None)
    with pytest.raises(InputError, match="unknown method 'toy'"):
        MethodSpec.parse("toy")
