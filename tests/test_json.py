"""Strict JSON: every JSON document keras_safe_dist writes parses under RFC 8259."""

import json
import math

import numpy as np
import pytest

from keras_safe_dist.core import _json

from conftest import strict_json


def test_non_finite_numbers_become_strings_that_float_reads_back():
    data = {"loss": float("nan"), "norms": [1.5, float("inf"), -float("inf")], "n": np.float32("nan")}
    text = _json.dumps(data, sort_keys=True)
    assert strict_json(text) == {"loss": "NaN", "n": "NaN", "norms": [1.5, "Infinity", "-Infinity"]}
    back = strict_json(text)["norms"]
    assert [float(v) for v in back] == [1.5, math.inf, -math.inf]


def test_finite_values_and_numpy_scalars_are_written_as_numbers():
    data = {"a": np.float32(0.5), "b": np.int64(3), "c": True, "d": None, "e": ("x", 2)}
    assert strict_json(_json.dumps(data)) == {"a": 0.5, "b": 3, "c": True, "d": None, "e": ["x", 2]}


def test_the_strict_parser_refuses_what_python_writes_by_default():
    with pytest.raises(ValueError, match="not RFC 8259 JSON: bare NaN"):
        strict_json(json.dumps({"loss": float("nan")}))


def test_write_replaces_the_file_whole_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "report.json"
    path.write_text('{"old": 1}')
    _json.write(str(path), {"grad_norm": float("nan")})
    assert strict_json(path.read_text()) == {"grad_norm": "NaN"}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
