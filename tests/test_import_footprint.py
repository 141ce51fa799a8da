"""What importing the client side pulls in, checked in one fresh interpreter (importing vLLM takes about 16 s
here, so the checks share it).

- No numba in an engine's process: vLLM 0.32 scans every module's globals at engine start and fails on llvmlite's ``ffi.lib`` (it
  answers any attribute, ``__dict__`` too), so the compiled kernels load when first wanted, never on import.
- No redis-py: it comes with the ``cluster`` extra; without it a single node's client, the store and the vLLM
  connector still import, and a redis:// target says what is missing.
"""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules['redis'] = None  # as if redis-py were not installed
import kvstore.checksum, kvstore.client, kvstore.integrations.vllm.worker
assert 'numba' not in sys.modules and 'llvmlite' not in sys.modules, 'numba imported'
import kvstore.server.app  # the store may load its kernels at start; it too needs no redis-py
try:
    kvstore.client.Client('redis://127.0.0.1:1')
except ImportError as err:
    print(err)
"""


def test_the_client_side_imports_neither_numba_nor_redis() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'kvstore[cluster]'" in out.stdout
