"""The store's compiled kernels are warmed up at start, off the request path (kvstore/store/warmup.py)."""

from __future__ import annotations

import os
import time

from kvstore.client import Client
from kvstore.store.policies import POLICY_NAMES, policy_factory
from kvstore.store.warmup import warm_up


def test_warm_up_runs_every_policy_and_leaves_nothing_behind():
    for name in POLICY_NAMES:
        assert warm_up(policy_factory(name)) >= 0.0


def test_a_server_warms_up_in_the_background_and_serves_meanwhile(make_server):
    server = make_server(warm_up=True)
    with Client(f"127.0.0.1:{server.port}") as kv:  # serving at once: the warm-up does not hold the start
        key = os.urandom(16)
        kv.put("ns", [key], [b"x" * 4096])
        assert bytes(kv.get("ns", [key])[0]) == b"x" * 4096
        deadline = time.monotonic() + 120
        while "warm_up_seconds" not in kv.stats()["counters"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kv.stats()["counters"]["warm_up_seconds"] > 0
        assert kv.stats()["blocks"] == 1  # the throwaway store's blocks are not this one's
