"""The wire from another language: tests/conformance/node/conformance.js (grpc-js, written from proto/ and DESIGN 2.1
alone) against a real `kvstore serve` with tenants: hash vectors, a chained Put/Lookup/Get/Delete, the per-block
CRC rejection, an aborted stream's handled count, dtype refusals, NOT_FOUND, UNAUTHENTICATED, PERMISSION_DENIED
and a namespace Stats. `make test` installs its node_modules (`npm ci`); without node or them it skips."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import ROOT, ServerProcess

NODE_DIR = ROOT / "tests" / "conformance" / "node"
TOKEN = "conformance-token-0123456789abcdef"
NODE = shutil.which("node")

pytestmark = [
    pytest.mark.skipif(NODE is None, reason="node is not installed (Node.js 18 or newer runs the conformance client)"),
    pytest.mark.skipif(
        not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(),
        reason="tests/conformance/node/node_modules is missing: run `npm ci --prefix tests/conformance/node` "
        "(make test does)",
    ),
]


def test_node_client_conforms(tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(
        yaml.safe_dump(
            [
                {"name": "conformance", "token": TOKEN, "namespaces": ["conformance"]},
                {"name": "other", "token": "other-token-0123456789abcdef0000", "namespaces": ["elsewhere"]},
            ]
        )
    )
    server = ServerProcess("--dram", "128MiB", "--tenants", str(tenants))  # this tree's server (cwd: the root)
    try:
        run = subprocess.run(
            [NODE, "conformance.js", "--target", server.target, "--proto", str(ROOT / "proto")]
            + ["--vectors", str(ROOT / "tests/data/hash_vectors.json")]
            + ["--namespace", "conformance", "--token", TOKEN, "--foreign", "elsewhere"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.terminate()
    lines = run.stdout.strip().splitlines()
    checks = [json.loads(line) for line in lines if line.startswith("{")]
    failed = [f"{c['check']}: {c['detail']}" for c in checks if not c["ok"]]
    assert not failed, "\n".join(failed)
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(checks) == 10 and lines[-1] == "10 passed, 0 failed", run.stdout
    assert not run.stderr.strip(), run.stderr  # no warnings (a proto that did not load, a deprecation)
