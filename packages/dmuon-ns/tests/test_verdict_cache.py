"""The on-disk verdict cache: where it lives, merging writers, atomic replacement, and several
processes filling one directory at once."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from pathlib import Path

import pytest

from dmuon_ns import _verdict_cache
from dmuon_ns._environment import CACHE_DIR_ENV

WRITERS, KEYS_PER_WRITER = 4, 30


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    warned = set(_verdict_cache._warned)
    _verdict_cache._warned.clear()
    yield tmp_path / "cache"
    _verdict_cache._warned.clear()
    _verdict_cache._warned.update(warned)


def _verdict(kernel: str) -> dict:
    return {"kernel": kernel, "times_ms": {kernel: 1.0}, "errors": {}, "rejected": {}}


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _verdict_cache.cache_dir() == tmp_path / ".cache" / "dmuon" / "ns-autotune"
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "elsewhere"))
    assert _verdict_cache.cache_dir() == tmp_path / "elsewhere"


def test_a_write_merges_with_what_another_process_wrote(_cache_dir):
    _verdict_cache.write({"a": _verdict("torch")})
    # Another process adds its verdict to the file behind this one's back ...
    data = json.loads((_cache_dir / "verdicts.json").read_text())
    data["verdicts"]["b"] = _verdict("quack")
    (_cache_dir / "verdicts.json").write_text(json.dumps(data))
    # ... and this one's next write keeps it.
    _verdict_cache.write({"c": _verdict("triton")})
    assert set(_verdict_cache.read()) == {"a", "b", "c"}


def test_a_failed_write_leaves_the_file_as_it_was(_cache_dir, monkeypatch, caplog):
    _verdict_cache.write({"a": _verdict("torch")})
    before = (_cache_dir / "verdicts.json").read_bytes()

    def interrupted(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_verdict_cache.os, "replace", interrupted)
    with caplog.at_level(logging.WARNING, logger="dmuon_ns._verdict_cache"):
        with pytest.warns(RuntimeWarning, match="No space left on device") as caught:
            _verdict_cache.write({"b": _verdict("quack")})
        assert [w.filename for w in caught] == [__file__]  # the caller's line
    assert (_cache_dir / "verdicts.json").read_bytes() == before
    assert sorted(p.name for p in _cache_dir.iterdir()) == ["verdicts.json", "verdicts.lock"]
    assert "No space left on device" in caplog.text


def test_a_file_of_another_format_is_ignored_with_a_warning(_cache_dir, caplog):
    _cache_dir.mkdir()
    (_cache_dir / "verdicts.json").write_text(json.dumps({"format": 0, "verdicts": {"a": {}}}))
    with caplog.at_level(logging.WARNING, logger="dmuon_ns._verdict_cache"):
        with pytest.warns(RuntimeWarning, match="not a format-1 verdict file"):
            assert _verdict_cache.read() == {}
        assert _verdict_cache.read() == {}
    assert caplog.text.count("not a format-1 verdict file") == 1


def test_delete_removes_the_file(_cache_dir):
    _verdict_cache.write({"a": _verdict("torch")})
    _verdict_cache.delete()
    assert _verdict_cache.read() == {}


def _fill(cache: str, writer: int, start: multiprocessing.synchronize.Barrier) -> None:
    """One process of the concurrency test: its verdicts, written one by one at full speed."""
    os.environ[CACHE_DIR_ENV] = cache
    start.wait()
    for i in range(KEYS_PER_WRITER):
        _verdict_cache.write({f"writer{writer}|key{i}": _verdict(f"k{writer}")})
        # Readers take no lock: whatever they find must parse.
        assert isinstance(_verdict_cache.read(), dict)


def test_concurrent_writers_fill_one_valid_complete_cache(_cache_dir):
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Barrier(WRITERS)
    writers = [
        spawn.Process(target=_fill, args=(str(_cache_dir), writer, start))
        for writer in range(WRITERS)
    ]
    for process in writers:
        process.start()
    for process in writers:
        process.join(timeout=300)  # spawning and importing torch is slow on a busy machine
    assert [process.exitcode for process in writers] == [0] * WRITERS
    data = json.loads((_cache_dir / "verdicts.json").read_text())
    assert data["format"] == 1
    expected = {f"writer{w}|key{i}" for w in range(WRITERS) for i in range(KEYS_PER_WRITER)}
    assert set(data["verdicts"]) == expected
    assert all(v["kernel"] == f"k{k.split('|')[0][6:]}" for k, v in data["verdicts"].items())
    # No temporary file is left behind.
    assert sorted(p.name for p in _cache_dir.iterdir()) == ["verdicts.json", "verdicts.lock"]
