"""KVStoreConnector in real tensor-parallel vLLM engines: three workers, each with a third of every layer's heads.

SmolLM2-135M's 9 query and 3 KV heads split over 3 ranks (worker processes, one OpenMP thread each, unbound:
this host has 2 cores). Each rank's part of a block is a store block of its own; before each rank had its own
keys, ranks 1 and 2 saved under rank 0's (refused as present) and loaded rank 0's heads: other tokens.
"""

from __future__ import annotations

import random
import time

import pytest

pytest.importorskip("vllm")

from kvstore.client import Client  # noqa: E402
from kvstore.integrations.vllm.identity import EngineShape, prompt_hashes  # noqa: E402
from kvstore.integrations.vllm.stats import read_stats, stats_files  # noqa: E402
from kvstore.integrations.vllm_engine import EngineProcess, EngineSpec, rank_shm_files  # noqa: E402
from kvstore.server.process import store_process  # noqa: E402

# one xdist worker runs every module of this group in turn: their vLLM engines side by side outgrew 24 GiB
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("vllm-engines")]
TP, BLOCK, PROMPT = 3, 32, 300
RANKS = tuple(f"vllm-LBHNC-tp{r}of{TP}" for r in range(TP))
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}  # vLLM's auto binding wants a NUMA node a rank


def test_each_rank_saves_and_loads_its_own_heads(tmp_path) -> None:
    from kvstore.model.hf_export import exported_smollm2

    try:
        model = str(exported_smollm2())
    except FileNotFoundError as err:
        pytest.skip(str(err))
    prompt = [random.Random(3).randrange(100, 40000) for _ in range(PROMPT)]
    shm_before = rank_shm_files()
    shape = EngineShape(model, "", "float32", 30, 3 // TP, 64, BLOCK, RANKS[0], 0, RANKS)
    chains = [prompt_hashes(prompt, shape.for_rank(r), "vllm") for r in range(TP)]
    full = (PROMPT - 1) // BLOCK  # blocks a consumer can load: one token is always computed

    with store_process("--dram", "512MiB") as (target, _), Client(target) as probe:
        extra = {"target": target, "timeout": 20, "stats_path": str(tmp_path)}
        spec = EngineSpec(model, "kvstore", "kv_both", extra, max_model_len=1024, tensor_parallel=TP, env=ENV)
        with EngineProcess(spec) as engine:  # one engine (each start costs about 25 s here): save, drop, load
            cold = engine.generate([prompt], 4)["outputs"][0]
            assert cold["cached"] == 0
            deadline = time.monotonic() + 60  # every rank saves its own part, in the background
            while [probe.lookup("vllm", chain) for chain in chains] != [PROMPT // BLOCK] * TP:
                assert time.monotonic() < deadline, [probe.lookup("vllm", chain) for chain in chains]
                time.sleep(0.2)
            engine.reset_prefix_cache()  # vLLM's own cache dropped: the prefix can only come from the store
            warm = engine.generate([prompt], 4)["outputs"][0]
            engine.proc.kill()  # ended as by a crash: vLLM's ranks leave their shared memory behind, close() not
    assert rank_shm_files() <= shm_before  # the ranks' shared-memory files went with the killed engine
    assert warm["cached"] == full * BLOCK
    assert warm["tokens"] == cold["tokens"]
    loaded = [read_stats(stats_files(tmp_path, r)[1]).get("load_blocks") for r in range(TP)]
    assert loaded == [full] * TP  # each rank loaded its own part of every block (its own stats file)
