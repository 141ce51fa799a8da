"""``bench.transfer --cases destination`` through a real store: every kind of memory gets the exact bytes."""

from __future__ import annotations

from bench import transfer_destination


def test_gets_into_every_kind_of_destination_memory_return_the_bytes_put(make_server):
    server = make_server(dram=512 << 20)
    rows = transfer_destination.measure(f"127.0.0.1:{server.port}", ["shm", "tcp"], reps=1)
    assert [r["lane"] for r in rows] == ["shm", "tcp"]
    for row in rows:  # measure() raises if any Get returned other bytes
        assert all(row[f"{kind}_gbps"] > 0 for kind in transfer_destination.KINDS)
        assert row["shared_pool_huge_pages"] in (True, False)
