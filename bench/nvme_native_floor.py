"""What a compiled data plane could reach on a store-read TCP Get from NVMe here: the floor with no Python.

    python -m bench.nvme_native_floor [--quick] [--runs 3] [--readers 1,2] [--piece 2MiB] [--dir /var/tmp]
                                      [--out FILE.json]

``bench.nvme_get`` has the store-read TCP lane at 0.3-0.7 of the disk's speed, and ``bench.nvme_floor`` puts
even a Python process that only reads, checks and sends under 0.6 at 64 KiB. This asks whether that is Python or
the machine. ``bench/native/tcp_floor.c`` (built here with the host's C compiler, ``$CC`` or ``cc``, for x86-64: it takes
the SSE4.2 CRC32C instruction) writes
prefixes of 32 records (a 4 KiB header page and a random block, as the NVMe tier lays them down) and then, in
two processes over loopback TCP, takes three steps a round in a rotating order, each on an extent read once:

- ``raw``: one O_DIRECT ``pread`` of a prefix's extent (the baseline, as ``bench.nvme_get``'s ``raw``);
- ``serial``: a Get whose server reads the extent in one ``pread``, checks the 32 CRC32Cs, then ``writev``s the
  payloads (what the store's TCP lane does for a prefix read in one piece);
- ``piped``: a Get whose server reads pieces of whole records of at most ``--piece`` bytes (one record where a
  record is larger; about equal, as the tier cuts a run, whose ``max_read_bytes`` is the default) on
  ``--readers`` threads, one read in flight each, while its serving thread checks and sends the pieces before,
  in order;

and in both Gets the client receives each block into its place in a 32-block buffer and checks its CRC32C as it
lands, as the TCP lane's client does (256 KiB pieces, ``SO_RCVLOWAT`` 1 MiB, 4 MiB socket buffers:
``kvstore/lanes/framing.py``; three-stream hardware CRC32C, ``crc_gbps`` its speed on one core). Every buffer
is in huge pages where the kernel grants them, as the store's are (an O_DIRECT read into 4 KiB pages ran at half
the speed here). Each of ``--runs`` runs writes and removes its own file.

Rows, per block size and ``readers``: the step's p50 ms in each run (``*_ms``), ``serial_vs_raw`` and
``piped_vs_raw`` (raw p50 / Get p50 in each run, then the median of the runs: 1 = as fast as the bare disk), and
the client's and server's CPU per Get. Against the store's ``tcp_nvme_vs_raw`` in a ``bench.nvme_get`` run taken
beside it, this is how much of the store-read TCP lane's gap a data plane outside Python could close here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.common import parse_args, positive, report
from kvstore.sizes import format_size, parse_size

SOURCE = Path(__file__).parent / "native" / "tcp_floor.c"
BLOCKS = (64 << 10, 512 << 10, 2 << 20)
ROUNDS = {64 << 10: 40, 512 << 10: 24, 2 << 20: 12}  # about 2.3 GB of extents a run at 2 MiB
QUICK_ROUNDS = 4
RUN_SECONDS = 600  # a run takes 2-10 s here; past this it is stuck (a disk that stopped answering)


def build(into: Path) -> Path:
    """Compiles tcp_floor.c with the host's C compiler; a clear exit where there is none."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise SystemExit("bench.nvme_native_floor needs a C compiler: install gcc or set CC")
    binary = into / "tcp_floor"
    cmd = [compiler, "-O2", "-msse4.2", "-pthread", "-o", str(binary), str(SOURCE)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"could not build {SOURCE.name} ({' '.join(cmd)}):\n{done.stderr}")
    return binary


def crc_of(binary: Path, path: Path) -> int:
    """The native CRC32C of a file's bytes (what the tests hold against kvstore.checksum)."""
    return int(subprocess.run([str(binary), "--crc", str(path)], capture_output=True, text=True, check=True).stdout, 16)


def run_once(binary: Path, root: Path, block: int, rounds: int, piece: int, readers: int) -> dict[str, Any]:
    """One run of the native floor on a file of its own, removed after."""
    path = root / f"floor-{block}-{readers}.dat"
    cmd = [str(binary), str(path), str(block), str(rounds), str(piece), str(readers)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_SECONDS)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"tcp_floor ran past {RUN_SECONDS} s: {' '.join(cmd)}") from None
    finally:
        path.unlink(missing_ok=True)
    if done.returncode:
        raise SystemExit(f"tcp_floor failed ({done.returncode}): {done.stderr.strip()}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def summarize(block: int, readers: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"block": format_size(block), "readers": readers, "pieces": runs[0]["pieces"]}
    p50 = {step: [statistics.median(r[f"{step}_ms"]) for r in runs] for step in ("raw", "serial", "piped")}
    for step, values in p50.items():
        row[f"{step}_ms"] = [round(v, 3) for v in values]
    for step in ("serial", "piped"):
        ratios = [raw / get for raw, get in zip(p50["raw"], p50[step], strict=True)]
        row[f"{step}_vs_raw"] = round(statistics.median(ratios), 3)
        row[f"{step}_vs_raw_runs"] = [round(x, 3) for x in ratios]
    for side in ("client", "server"):
        row[f"{side}_cpu_ms_per_get"] = round(statistics.median(r[f"{side}_cpu_ms_per_get"] for r in runs), 3)
    row["crc_gbps"] = round(statistics.median(r["crc_gbps"] for r in runs), 2)
    return row


def main(argv: list[str] | None = None) -> None:
    def configure(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--runs", type=positive(int), default=None, help="runs of each case, each on its own file (default 3)"
        )
        p.add_argument(
            "--readers",
            default="1,2",
            metavar="N,...",
            help="the server's reading threads, one case each (default 1,2)",
        )
        p.add_argument("--piece", type=parse_size, default=2 << 20, help="most bytes a piped read takes (default 2MiB)")
        p.add_argument(
            "--dir", type=Path, default=Path("/var/tmp"), help="where the extents' file goes (a disk, not tmpfs)"
        )

    args = parse_args(
        "a store-read TCP Get from NVMe in C: the floor a compiled data plane could reach", argv, configure
    )
    try:
        readers = [int(r) for r in args.readers.split(",") if r]
    except ValueError:
        raise SystemExit(f"--readers: not a list of whole numbers: {args.readers!r}") from None
    if not readers or any(not 1 <= r <= 8 for r in readers):
        raise SystemExit("--readers: one or more counts from 1 to 8")
    runs = args.runs or (1 if args.quick else 3)
    args.dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvstore-native-floor-", dir=args.dir))
    rows = []
    try:
        binary = build(root)
        cases = [(block, r) for block in BLOCKS for r in readers]
        with tqdm(total=len(cases) * runs, desc="native TCP floor", unit="run") as bar:
            results: dict[tuple[int, int], list[dict[str, Any]]] = {case: [] for case in cases}
            for _ in range(runs):  # every case once before any twice: the host drifts
                for block, r in cases:
                    rounds = QUICK_ROUNDS if args.quick else ROUNDS[block]
                    results[block, r].append(run_once(binary, root, block, rounds, args.piece, r))
                    bar.update()
        rows = [summarize(block, r, results[block, r]) for block, r in cases]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(
        rows,
        args,
        title="store-read TCP Gets from NVMe with no Python: p50 ms a run and Get / raw read",
        bench="nvme_native_floor",
    )


if __name__ == "__main__":
    main()
