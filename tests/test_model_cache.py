"""The model cache's keys and its pruning (``kvstore/model/model_cache.py``): the same GGUF bytes keep one entry
wherever and whenever they were installed, and a new entry removes those an older file of the same name left."""

from __future__ import annotations

import os

import pytest

from kvstore.model import model_cache
from kvstore.model.model_cache import cache_key, drop_stale_entries


def test_the_same_bytes_have_one_key_wherever_and_whenever_they_were_written(tmp_path) -> None:
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    os.utime(b, ns=(1, 1))  # another install: the same bytes, another mtime
    assert cache_key(a) == cache_key(b)
    assert cache_key(a).startswith(f"m-{a.stat().st_size}-")
    b.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 64)  # the same size, other bytes
    assert cache_key(b) != cache_key(a)


def test_a_new_entry_drops_what_an_older_file_of_that_name_left(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_CACHE_DIR", str(tmp_path))
    assert model_cache.cache_dir() == tmp_path
    current = "M.Q4_1-98362432-070859651542f655"
    stale = [  # the old key held the file's mtime in nanoseconds
        "M.Q4_1-98362432-1796622990272344984.safetensors",
        "M.Q4_1-98362432-1796622990272344984.json",
        "hf/M.Q4_1-98362432-1796622990272344984-float32",
        "real_kv/M.Q4_1-98362432-1796622990272344984-v2-n8-b16-float32-s0.safetensors",
    ]
    kept = [
        f"{current}.safetensors",
        f"{current}.json",
        f"{current}.safetensors.tmp123",  # another process writing the current entry
        f"hf/{current}-float32",
        "M.Q4_1-98362433-1796622990272344984.json",  # another size: another file
        "N.Q4_1-98362432-1796622990272344984.json",  # another model
        "M.Q4_1-98362432.json",  # not an entry's name
    ]
    for name in stale + kept:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.startswith("hf/"):
            path.mkdir()
            (path / "model.safetensors").write_bytes(b"w")
        else:
            path.write_bytes(b"x")
    assert drop_stale_entries(current) == len(stale)
    assert not any((tmp_path / name).exists() for name in stale)
    assert all((tmp_path / name).exists() for name in kept)
    assert drop_stale_entries(current) == 0
