"""A ``load_planner`` for the connector tests: the default cost planner, which also kills the store between a
Lookup and its load, once, on demand.

The test writes the store's pid into the file named by ``KVSTORE_TEST_FAULT``; the next planned load in the
engine (scheduler side, right after its Lookup found hits) kills that store, so the worker's Gets fail. While a
file ``<KVSTORE_TEST_FAULT>.load-all`` exists, every hit is loaded whatever the cost planner chose (a test of a
failing load needs a load: the planner may rightly recompute a short prompt whose blocks sit on NVMe).
"""

from __future__ import annotations

import os
import signal
import time

from kvstore.integrations.vllm.planning import CostPlanner
from kvstore.integrations.vllm.scheduler import LoadQuery


class KillStoreAfterLookup(CostPlanner):
    def __call__(self, query: LoadQuery) -> int:
        path = os.environ.get("KVSTORE_TEST_FAULT", "")
        if query.hit_blocks and path and os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                pid = int(f.read().strip())
            os.unlink(path)
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)  # its sockets close with it; the test process reaps it
        chosen = super().__call__(query)
        return query.hit_blocks if path and os.path.exists(path + ".load-all") else chosen
