"""dmuon-plan on bad input: one error line that names the file and what is wrong, exit 2."""

from __future__ import annotations

import json

import pytest

from dmuon.plan import model_shapes
from dmuon.plan._cli import main

LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run dmuon-plan, expect exit status 2 and nothing on stdout; its one stderr line."""
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dmuon-plan: error: ")
    return lines[0]


def test_a_config_that_is_not_a_json_object_is_one_error_naming_the_file(tmp_path, capsys) -> None:
    good = json.dumps(LLAMA, indent=2)
    truncated = tmp_path / "truncated.json"
    truncated.write_text(good[: good.index('"vocab_size"') + 5])  # a download cut short
    line = _error([str(truncated), "--ranks", "8"], capsys)
    assert f"'{truncated}' is not valid JSON: line 8, column 3:" in line
    assert "Unterminated string" in line and "the file ends there" in line
    malformed = tmp_path / "malformed.json"
    malformed.write_text(good.replace('"num_hidden_layers": 2,', '"num_hidden_layers": 2,,'))
    line = _error([str(malformed), "--ranks", "8"], capsys)
    assert f"'{malformed}' is not valid JSON: line 5, column 26:" in line
    assert "Expecting property name" in line and "ends there" not in line
    for text, kind in (("[1, 2]", "an array"), ("null", "null"), ('"llama"', "a string")):
        (tmp_path / "not_an_object.json").write_text(text)
        line = _error([str(tmp_path / "not_an_object.json"), "--ranks", "8"], capsys)
        assert f"not_an_object.json' holds {kind}, not a JSON object" in line
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"model_type": "\xff"}')
    line = _error([str(binary), "--ranks", "8"], capsys)
    assert f"'{binary}' is not UTF-8 text (byte 16" in line


def test_a_path_without_a_config_is_one_error_naming_it(tmp_path, capsys) -> None:
    missing = tmp_path / "missing" / "config.json"
    line = _error([str(missing), "--ranks", "8"], capsys)
    assert f"'{missing}' does not exist; pass a config.json or a model directory" in line
    line = _error([str(tmp_path), "--ranks", "8"], capsys)
    assert f"'{tmp_path}' is a directory without a config.json" in line
    # The same messages from Python, as ValueError.
    with pytest.raises(ValueError, match=r"does not exist; pass a config.json"):
        model_shapes(missing)
