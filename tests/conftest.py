"""Shared fixtures: real store servers on loopback ports (in-process or as a subprocess)."""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from kvstore.client import Client
from kvstore.config import ServeConfig
from kvstore.free_port import free_port
from kvstore.server.app import StoreServer
from kvstore.server.process import serving

ROOT = Path(__file__).resolve().parent.parent
STOP_SECONDS = 60.0  # an in-process store that takes longer to stop is hung (a deadlock): fail, do not wait
_hung: list[str] = []

# hypothesis's 200 ms per example is a timing assertion: a loaded CI host stalls an example past it now and then
settings.register_profile("kvstore", deadline=None)
settings.load_profile("kvstore")


@pytest.fixture(autouse=True)
def _each_test_may_pick_its_store() -> Iterator[None]:
    """A client process lets one store read its memory (cma.allow_reader); a test that talked to a store process
    would otherwise leave the next test's store refused (direct mode off), so results depended on test order."""
    yield
    from kvstore.lanes import cma

    cma.forget_reader()


_PASSED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    if report.when == "call":
        item.stash[_PASSED] = report.passed
    return report


@pytest.fixture(autouse=True)
def _a_passed_test_gives_its_disk_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """A passed test's ``tmp_path`` is removed once the fixtures set up after this one (a store on it) have stopped;
    a failed test's stays for a look. Kept to the end of the run, they took 14 GB (NVMe segments of 64 MiB, bench
    runs' files): more free disk than a CI runner may have."""
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is not None and request.node.stash.get(_PASSED, False):
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def compiled_kernels() -> None:
    """The copy and CRC32C kernels and the compiled runs compiled (or loaded from numba's cache) before a module's
    tests run, so they test the compiled paths, not the fallbacks taken while compiling (an shm lane client reads
    the store's NVMe files only once its runs are compiled: the store reads them until then)."""
    from kvstore import indexed_runs, memops_jit, payload_runs

    memops_jit.warm_up()
    assert memops_jit.ready()
    payload_runs.COMPILED.warm_up()
    assert payload_runs.ready()
    indexed_runs.COMPILED.warm_up()
    assert indexed_runs.ready()


@pytest.fixture
def make_server() -> Iterator[Callable[..., StoreServer]]:
    """Start in-process servers on 127.0.0.1:<free port>; all are stopped at teardown."""
    servers: list[StoreServer] = []

    def start(**overrides) -> StoreServer:
        # cuda_ipc lanes of in-process servers run on their cpu stand-in: CUDA cannot open an IPC handle in
        # the process that made it (tests/test_cuda_lane.py runs the real one against a server process).
        cfg = ServeConfig(
            **{
                "listen": "127.0.0.1:0",
                "dram": 256 << 20,
                "metrics_port": 0,
                "drain_seconds": 1.0,
                "cuda_lane_device": "cpu",
                "warm_up": False,  # in-process: the kernels are this process's, compiled by the first test's use
                **overrides,
            }
        )
        server = StoreServer(cfg).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        stop_within(server, STOP_SECONDS)


def stop_within(server: StoreServer, seconds: float) -> None:
    """Stop ``server``, or fail the test with every thread's stack: pytest-timeout times a test's teardown only
    until it has fired once, so a store hung in its stop would hold the whole run (CI) until its own limit."""
    stopping = threading.Thread(target=server.stop, args=(0,), name="test-server-stop", daemon=True)
    stopping.start()
    stopping.join(seconds)
    if stopping.is_alive():
        faulthandler.dump_traceback(all_threads=True)
        _hung.append(f"127.0.0.1:{server.port}")
        pytest.fail(
            f"the store did not stop within {seconds:.0f} s (a deadlock?): every thread's stack is in the captured stderr"
        )


@pytest.hookimpl(tryfirst=True)  # before any fixture: the vLLM tests' fixtures start engines
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under ``--dist loadgroup`` a test marked ``xdist_group`` must carry its group in its id, or xdist spreads the
    group over the workers (the vLLM tests would start their engines twice, side by side: 24 GiB is not enough
    for that). pytest 9.2 with pytest-xdist 3.8 does so without a word (pytest-dev/pytest-xdist#1386)."""
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group"):
        if "@" not in item.nodeid:
            pytest.fail(
                "this pytest and pytest-xdist ignore xdist_group (pytest-dev/pytest-xdist#1386): install the test "
                "extra's pins (pytest<9.2), or run in one process (make test TEST_WORKERS=0)",
                pytrace=False,
            )


def pytest_unconfigure(config: pytest.Config) -> None:
    if _hung:  # the hung store's threads would keep the interpreter from exiting: end now, the report is out
        print(f"exiting: in-process stores that never stopped: {', '.join(_hung)}", file=sys.stderr, flush=True)
        os._exit(1)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path, for a store's --shm-dir: the shm lane's socket lives there and a unix
    socket's path holds 107 bytes, which tmp_path under pytest-xdist (.../popen-gw0/<test name>/) can exceed."""
    path = Path(tempfile.mkdtemp(prefix="kvt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def server(make_server) -> StoreServer:
    return make_server()


@pytest.fixture
def client(server) -> Iterator[Client]:
    with Client(f"127.0.0.1:{server.port}", timeout=30) as c:
        yield c


class ServerProcess:
    """`kvstore serve` in a subprocess (for kill -9, SIGTERM and RSS tests)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore", "serve", "--listen", self.target, "--metrics-port", "0", *args],
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        # Drain the server's output on a thread: an unread pipe fills up and then blocks every
        # server thread that logs, which looks exactly like a server hang.
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self.wait_ready()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.append(line)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._reader.join(5)
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.output()}")
            if serving(self.target):
                return
            time.sleep(0.2)
        raise TimeoutError("server did not become healthy")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def terminate(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def wait_exit(self, timeout: float = 30.0) -> int:
        """The exit code; a server still running after ``timeout`` fails the test with its threads' stacks."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server still running after {timeout}s; {self.stacks()}") from None

    def stacks(self) -> str:
        """Its output so far, then its threads' stacks (SIGUSR1: `kvstore serve` dumps them): where it hangs."""
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        return f"its output and stacks:\n{self.output()[-20000:]}"

    def output(self) -> str:
        """What the server printed so far (all of it once the process has exited)."""
        if self.proc.poll() is not None:
            self._reader.join(5)
        return "".join(self._lines)


@pytest.fixture
def spawn_server() -> Iterator[Callable[..., ServerProcess]]:
    procs: list[ServerProcess] = []

    def spawn(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        p = ServerProcess(*args, env=env)
        procs.append(p)
        return p

    yield spawn
    for p in procs:
        if p.proc.poll() is None:
            p.kill9()
