"""numba, when the extra ``fast`` installed it and ``KVSTORE_NO_JIT`` does not turn it off: ``numba`` (the
module, or None) and ``AVAILABLE``. The compiled kernels (the store's ``*_jit`` modules, ``memops_jit``) import it from here."""

from __future__ import annotations

import os
from typing import Any


def _load() -> Any:
    if os.environ.get("KVSTORE_NO_JIT"):
        return None
    try:  # pragma: no cover - depends on the environment
        import numba as module
    except ImportError:  # pragma: no cover
        return None
    return module


numba: Any = _load()
AVAILABLE = numba is not None
