"""Regenerate the gRPC stubs in kvstore/v1 from proto/: `python -m kvstore.genproto`.

`--out DIR` writes them elsewhere (the staleness test compares a fresh run with
the committed files).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # test extra; not needed at run time

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sorted(str(p) for p in (PROTO_DIR / "kvstore" / "v1").glob("*.proto")),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    gen = out_dir / "kvstore" / "v1"
    return sorted(gen.glob("*_pb2*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write kvstore/v1/*_pb2*.py under")
    files = generate(parser.parse_args().out)
    sys.stdout.write("".join(f"wrote {f}\n" for f in files))


if __name__ == "__main__":
    main()
