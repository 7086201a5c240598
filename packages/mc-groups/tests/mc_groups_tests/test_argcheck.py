"""The shared argument checks: what each accepts (normalised) and refuses, and the message
shape ``<name>=<value> must be …`` (no processes; exact comparisons)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from mc_groups import argcheck as ac


def test_flags_are_bools_only() -> None:
    assert ac.check_flag("bias", True) is True
    assert ac.check_flag("bias", False) is False
    for bad in ("no", 1, 0, None, np.bool_(True)):
        with pytest.raises(TypeError, match=r"^bias=.* must be a bool \(True or False\)$"):
            ac.check_flag("bias", bad)


def test_ints_refuse_bools_and_floats_and_check_the_minimum() -> None:
    assert ac.check_int("tp", 4) == 4
    assert type(ac.check_int("tp", np.int64(3))) is int
    assert ac.check_int("limit", 0, minimum=0) == 0
    with pytest.raises(TypeError, match="a bool is not a number"):
        ac.check_int("tp", True)
    with pytest.raises(TypeError, match=r"tp=2.0 must be an int"):
        ac.check_int("tp", 2.0)
    with pytest.raises(ValueError, match=r"^tp=0 must be >= 1$"):
        ac.check_int("tp", 0)
    assert ac.check_optional_int("bucket_size", None) is None
    with pytest.raises(ValueError, match="bucket_size=-1 must be >= 1"):
        ac.check_optional_int("bucket_size", -1)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, float("nan")])
def test_reals_must_be_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="must be finite"):
        ac.check_real("scaling_factor", bad)


def test_reals_normalise_and_check_the_sign() -> None:
    assert ac.check_real("x", Fraction(1, 4)) == 0.25
    assert ac.check_real("x", 0, positive=True) == 0.0
    with pytest.raises(ValueError, match=r"x=0 must be > 0"):
        ac.check_real("x", 0, positive=True, allow_zero=False)
    with pytest.raises(ValueError, match=r"x=-1 must be >= 0"):
        ac.check_real("x", -1, positive=True)
    for bad in (True, "1", None, torch.tensor(1.0)):
        with pytest.raises(TypeError, match="must be a real number"):
            ac.check_real("x", bad)


def test_float_dtypes() -> None:
    assert ac.check_float_dtype("params_dtype", torch.bfloat16) is torch.bfloat16
    assert ac.check_float_dtype("output_dtype", None, allow_none=True) is None
    bad: list[Any] = [torch.int64, "bf16", None, torch.bool]
    for value in bad:
        with pytest.raises(TypeError, match="floating-point"):
            ac.check_float_dtype("params_dtype", value)


def test_tensors_and_patterns() -> None:
    t = torch.zeros(1)
    assert ac.check_tensor("input", t) is t
    with pytest.raises(TypeError, match=r"input must be a torch\.Tensor, got list"):
        ac.check_tensor("input", [1.0])
    assert ac.check_patterns("patterns", ["all", "*.bias"]) == ("all", "*.bias")
    with pytest.raises(TypeError, match=r"\['all'\]"):
        ac.check_patterns("patterns", "all")
    with pytest.raises(TypeError, match="holds 1"):
        ac.check_patterns("patterns", [1])


def test_ints_check_a_maximum_and_the_bounds_themselves() -> None:
    assert ac.check_int("world_size", 8, maximum=8) == 8
    with pytest.raises(ValueError, match=r"^world_size=9 must be <= 8$"):
        ac.check_int("world_size", 9, maximum=8)
    bad_bounds: list[Any] = ["1", 1.5, None, True]
    for bound in bad_bounds:
        with pytest.raises(TypeError, match=r"^minimum=.* must be an int$"):
            ac.check_int("n", 3, minimum=bound)
    with pytest.raises(TypeError, match=r"^maximum='9' must be an int$"):
        ac.check_optional_int("n", 3, maximum="9")  # type: ignore[arg-type]


def test_strs() -> None:
    assert ac.check_str("label", "") == ""
    assert ac.check_str("label", "grad reduce") == "grad reduce"
    for bad in (3, None, b"x", ["a"]):
        with pytest.raises(TypeError, match=r"^label=.* must be a str$"):
            ac.check_str("label", bad)
    with pytest.raises(ValueError, match=r"^name='' must be a non-empty str$"):
        ac.check_str("name", "", allow_empty=False)


def test_the_checks_own_switches_are_bools() -> None:
    with pytest.raises(TypeError, match=r"^positive='no' must be a bool"):
        ac.check_real("x", 1.0, positive="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^allow_zero=1 must be a bool"):
        ac.check_real("x", 1.0, allow_zero=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^allow_none=0.0 must be a bool"):
        ac.check_float_dtype("d", torch.float32, allow_none=0.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^allow_empty='' must be a bool"):
        ac.check_str("s", "", allow_empty="")  # type: ignore[arg-type]
