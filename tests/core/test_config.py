"""triclip.core.config: bounds and choices declared on a config's fields, checked in one place; fields carried over."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from triclip.core.config import bounded, carry, check_device, check_fields, literal_choices
from triclip.core.errors import UserError


@dataclass
class Inner:
    max_pixels: int = bounded(100, low=1)  # bigger images are skipped


@dataclass
class Settings:
    dims: list[int] | None = bounded(None, low=1)  # m's
    batch_size: int = bounded(64, low=2, why=" (negatives)")  # pairs per step
    lr: float | None = bounded(None, above=0)  # learning rate
    target: float = bounded(0.95, above=0, high=1)  # recall target
    mode: Literal["fast", "slow"] | None = None  # how to run
    k: int = bounded(10, low=1, flags=["-k"])  # hits
    inner: Inner = field(default_factory=Inner)  # nested


@pytest.mark.parametrize("values, message", [
    ({"dims": [16, 0]}, "--dims must be >= 1, got 16,0"),
    ({"batch_size": 1}, "--batch-size must be >= 2 (negatives), got 1"),
    ({"lr": 0.0}, "--lr must be > 0, got 0.0"),
    ({"target": 1.5}, "--target must be <= 1, got 1.5"),
    ({"mode": "medium"}, "--mode must be one of fast, slow, got 'medium'"),
    ({"k": 0}, "-k must be >= 1, got 0"),
    ({"inner": Inner(max_pixels=0)}, "--max-pixels must be >= 1, got 0"),
])  # fmt: skip
def test_a_value_out_of_bounds_is_one_line_naming_the_option(values, message):
    with pytest.raises(UserError) as err:
        check_fields(Settings(**values))
    assert str(err.value) == message


def test_values_within_bounds_and_none_pass():
    check_fields(Settings())
    check_fields(Settings(dims=[1, 256], batch_size=2, lr=1e-9, target=1.0, mode="slow", k=1))
    assert literal_choices(Literal["a", "b"] | None) == ("a", "b") and literal_choices(int) == ()


def test_the_device_is_checked_by_name():
    for good in (None, "cpu", "cuda", "cuda:1", "mps"):
        check_device(good)
    for bad in ("gpu", "cuda:x", "CPU", ""):
        with pytest.raises(UserError, match="choose cpu, cuda or cuda:N"):
            check_device(bad)


def test_carry_takes_the_fields_of_the_same_name_and_the_renamed_ones():
    @dataclass
    class Model:
        preset: str = "tiny"
        batch_size: int = 1
        lr: float = 0.0
        other: str = "default"

    got = carry(Model, Settings(batch_size=32, lr=0.5), preset="lite")
    assert got == Model(preset="lite", batch_size=32, lr=0.5, other="default")
