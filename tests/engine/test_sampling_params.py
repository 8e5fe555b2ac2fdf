"""Validation and normalisation of SamplingParams."""

from __future__ import annotations

import math
from typing import Any

import pytest

from turbospec.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == -1
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.max_tokens == 16
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.logprobs is None
    assert p.include_stop_str_in_output is False
    assert p.skip_special_tokens is True
    assert not p.greedy


def test_module_does_not_import_torch() -> None:
    # The API layer builds params without torch. Inspect the module's own
    # imports (not sys.modules) so other packages' imports cannot interfere.
    import ast

    import turbospec.sampling_params as module

    tree = ast.parse(open(module.__file__, encoding="utf-8").read())
    imported: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.append(node.module)
    assert not [name for name in imported if name.split(".")[0] in {"torch", "numpy"}]


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"temperature": -1}, ["temperature", ">= 0", "-1"]),
        ({"temperature": float("nan")}, ["temperature", "nan"]),
        ({"temperature": float("inf")}, ["temperature", "inf"]),
        ({"temperature": "hot"}, ["temperature", "hot"]),
        ({"temperature": True}, ["temperature"]),
        ({"top_p": 0}, ["top_p", "(0, 1]", "got 0"]),
        ({"top_p": 1.5}, ["top_p", "(0, 1]", "1.5"]),
        ({"top_p": -0.1}, ["top_p", "-0.1"]),
        ({"top_p": float("nan")}, ["top_p"]),
        ({"top_p": "0.9"}, ["top_p"]),
        ({"top_k": -2}, ["top_k", "-1 (disabled) or >= 1", "-2"]),
        ({"top_k": 2.0}, ["top_k", "2.0"]),
        ({"top_k": None}, ["top_k"]),
        ({"min_p": -0.1}, ["min_p", "[0, 1]", "-0.1"]),
        ({"min_p": 1.1}, ["min_p", "[0, 1]", "1.1"]),
        ({"n": 0}, ["n must be >= 1", "0"]),
        ({"n": 1.0}, ["n must be an int"]),
        ({"max_tokens": 0}, ["max_tokens", ">= 1", "0"]),
        ({"max_tokens": -5}, ["max_tokens", "-5"]),
        ({"max_tokens": 1.5}, ["max_tokens", "1.5"]),
        ({"max_tokens": True}, ["max_tokens", "True"]),
        ({"seed": 1.0}, ["seed", "1.0"]),
        ({"seed": True}, ["seed", "True"]),
        ({"seed": "42"}, ["seed", "42"]),
        ({"logprobs": -1}, ["logprobs", "[0, 20]", "-1"]),
        ({"logprobs": 21}, ["logprobs", "[0, 20]", "21"]),
        ({"logprobs": 2.0}, ["logprobs", "2.0"]),
        ({"logprobs": False}, ["logprobs"]),
        ({"stop": ""}, ["stop", "non-empty"]),
        ({"stop": ["ok", ""]}, ["stop", "non-empty"]),
        ({"stop": ["ok", 3]}, ["stop", "3"]),
        ({"stop": 3}, ["stop", "3"]),
        ({"stop_token_ids": [1, -2]}, ["stop_token_ids", "-2"]),
        ({"stop_token_ids": [1, 2.0]}, ["stop_token_ids", "2.0"]),
        ({"stop_token_ids": [True]}, ["stop_token_ids"]),
        ({"stop_token_ids": 5}, ["stop_token_ids", "5"]),
        ({"ignore_eos": 1}, ["ignore_eos"]),
        ({"skip_special_tokens": "yes"}, ["skip_special_tokens"]),
        ({"include_stop_str_in_output": None}, ["include_stop_str_in_output"]),
    ],
)
def test_invalid_values_raise_with_field_name(kwargs: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_exact_messages() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"temperature": -1}, "temperature must be >= 0, got -1"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
        ({"top_k": -2}, "top_k must be -1 (disabled) or >= 1, got -2"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as info:
            SamplingParams(**kwargs)
        assert str(info.value) == message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"temperature": 0.0},
        {"temperature": 2},
        {"top_p": 1},
        {"top_p": 1e-6},
        {"top_k": 1},
        {"top_k": 50},
        {"min_p": 0},
        {"min_p": 1},
        {"seed": 0},
        {"seed": -7},
        {"seed": 2**70},
        {"max_tokens": 1},
        {"logprobs": 0},
        {"logprobs": 20},
        {"n": 4},
    ],
)
def test_boundary_values_accepted(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)


def test_numeric_fields_normalised_to_float() -> None:
    p = SamplingParams(temperature=2, top_p=1, min_p=0)
    assert isinstance(p.temperature, float)
    assert isinstance(p.top_p, float)
    assert isinstance(p.min_p, float)


def test_stop_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_stop_list_is_copied() -> None:
    user_stop = ["x"]
    p = SamplingParams(stop=user_stop)
    user_stop.append("y")
    assert p.stop == ["x"]


def test_top_k_zero_means_disabled() -> None:
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(top_k=5).top_k == 5


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_clone_applies_overrides_and_revalidates() -> None:
    base = SamplingParams(temperature=0.5, stop=["a"], seed=3)
    copy = base.clone(max_tokens=4)
    assert copy.max_tokens == 4
    assert copy.temperature == 0.5 and copy.seed == 3
    assert copy == base.clone(max_tokens=4)
    assert base.max_tokens == 16
    # Lists are not shared with the original.
    copy.stop.append("b")
    assert base.stop == ["a"]
    assert base.clone() == base
    with pytest.raises(ValueError, match="top_p"):
        base.clone(top_p=0)
    assert base.clone(stop="z").stop == ["z"]
    assert base.clone(top_k=0).top_k == -1


def test_no_nan_slips_through_min_p() -> None:
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=math.nan)
