"""The prefill and decode workers' flags: a bad one ends the process with one line naming it, not a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvstore.model.worker import parse_args


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--listen", "bogus"], "--listen: not HOST:PORT"),
        (["--listen", "127.0.0.1:99999"], "--listen: not HOST:PORT"),  # gRPC would bind port 34463
        (["--pool-blocks", "0"], "--pool-blocks and --chunk-tokens: 1 or more"),
        (["--chunk-tokens", "-5"], "--pool-blocks and --chunk-tokens: 1 or more"),
        (["--log-level", "loud"], "--log-level: debug, info, warning or error"),
    ],
)
def test_bad_flags_are_refused_before_anything_starts(flags, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args("prefill_node", "127.0.0.1:7080", flags)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_defaults_parse():
    args = parse_args("decode_node", "127.0.0.1:7090", ["--store", "none"])
    assert (args.listen, args.store, args.pool_blocks) == ("127.0.0.1:7090", None, 2048)


def run_worker(module: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, "--store", "none", *flags], capture_output=True, text=True, timeout=120
    )


def test_an_unknown_model_and_a_taken_port_are_one_line_each(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 10)
    for model in ("nope", str(junk), str(tmp_path)):  # a name, a file that is no GGUF, a dir with no config.json
        result = run_worker("prefill_node", "--listen", "127.0.0.1:0", "--model", model)
        assert result.returncode == 1 and f"--model {model}: " in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = run_worker("decode_node", "--listen", address, "--model", "tiny")
    assert result.returncode == 1 and f"--listen {address}: cannot listen there" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
