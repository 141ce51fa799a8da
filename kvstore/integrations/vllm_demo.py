"""Disaggregated prefill/decode on two real vLLM engines over ``kvstore serve``: the main demo's vLLM path.

    python -m kvstore.integrations.vllm_demo [--turns 3] [--answer-tokens 40]

``main(argv)`` starts a store, a prefill engine (``kv_producer``, vLLM multiprocessing off) and a decode engine
(``kv_consumer``, multiprocessing on), each its own process, and runs a chat over a shared system prompt.
Per turn:

1. the prefill engine computes the whole prompt from scratch (its own cache dropped): the TTFT without the
   store, and the new full blocks go to the store in the background;
2. the decode engine, which keeps its own cache of the chat so far, takes the rest of the prefix from the
   store (the TTFT with the store: bytes moved and the load's bandwidth from its connector's counters) and
   generates the answer;
3. the prefill engine generates the same answer itself: the tokens must match.

Nothing is downloaded: the model is the bundled SmolLM2 (``kvstore export-model``). Returns 0 when every turn's
tokens matched.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstore.integrations.vllm_engine import EngineProcess, EngineSpec
from kvstore.server.process import free_port

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = (
    "You are the support assistant of a company that runs a tiered key-value cache for large language model "
    "serving. The cache keeps attention key and value blocks in GPU memory, host memory and NVMe drives, "
    "moves them over shared memory or TCP, and lets a prefill server hand a prompt's blocks to a decode "
    "server. Answer in short, precise sentences. "
) * 6
QUESTIONS = [
    "What does the prefill server do?",
    "Why does the decode server not recompute the prompt?",
    "What happens when a block is missing from the cache?",
    "Where are cold blocks kept?",
]


def _start_store(tmp: Path) -> tuple[str, subprocess.Popen[bytes]]:
    target = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--listen", target, "--metrics-port", "0", "--log-level",
         "error", "--dram", "1GiB", "--nvme-dir", str(tmp / "nvme"), "--nvme", "2GiB"],
        cwd=ROOT,
    )  # fmt: skip
    while subprocess.run(
        [sys.executable, "-m", "kvstore", "health", "--target", target, "--timeout", "1"],
        capture_output=True,
        cwd=ROOT,
    ).returncode:
        if proc.poll() is not None:
            raise RuntimeError("kvstore serve exited")
        time.sleep(0.2)
    return target, proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=3, help="chat turns (default: %(default)s)")
    parser.add_argument("--answer-tokens", type=int, default=40, help="tokens per answer (default: %(default)s)")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from kvstore.model.hf_export import exported_smollm2

    model = str(exported_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    all_match = True
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        target, store = _start_store(tmp)
        print(f"kvstore serve on {target}; starting a prefill and a decode vLLM engine (SmolLM2-135M, CPU) ...")
        common = {"target": target}
        try:
            with (
                EngineProcess(
                    EngineSpec(model, "kvstore", "kv_producer", {**common, "stats_path": str(tmp / "p")}, mp=False)
                ) as prefill,
                EngineProcess(
                    EngineSpec(model, "kvstore", "kv_consumer", {**common, "stats_path": str(tmp / "d")}, mp=True)
                ) as decode,
            ):
                print(f"engines up in {prefill.start_seconds:.0f} s and {decode.start_seconds:.0f} s\n")
                warm = tok.encode("warm up " * 100)  # a first save and load: lanes negotiated, buffers touched
                prefill.generate([warm], 1)
                prefill.wait_saves()
                decode.generate([warm], 1)
                messages = [{"role": "system", "content": SYSTEM}]
                header = (
                    f"{'turn':>4} {'prompt':>7} {'from store':>10} {'TTFT recompute':>15} {'TTFT via store':>15} "
                    f"{'speedup':>8} {'MB moved':>9} {'GB/s':>6}  match"
                )
                print(header)
                for turn in range(args.turns):
                    messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
                    encoded: Any = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                    prompt = [int(t) for t in (encoded["input_ids"] if hasattr(encoded, "keys") else encoded)]
                    prefill.reset_prefix_cache()
                    cold = prefill.generate([prompt], 1)
                    prefill.wait_saves()
                    before = decode.worker_stats()
                    first = decode.generate([prompt], 1)
                    after = decode.worker_stats()
                    answer = decode.generate([prompt], args.answer_tokens, ignore_eos=False)["outputs"][0]["tokens"]
                    reference = prefill.generate([prompt], args.answer_tokens, ignore_eos=False)["outputs"][0]["tokens"]
                    moved = after.get("load_bytes", 0) - before.get("load_bytes", 0)
                    seconds = after.get("load_seconds", 0.0) - before.get("load_seconds", 0.0)
                    loaded = (after.get("load_blocks", 0) - before.get("load_blocks", 0)) * 32
                    match = answer == reference
                    all_match &= match
                    print(
                        f"{turn + 1:>4} {len(prompt):>7} {loaded:>10} {cold['seconds']:>14.3f}s "
                        f"{first['seconds']:>14.3f}s {cold['seconds'] / first['seconds']:>7.1f}x "
                        f"{moved / 1e6:>9.1f} {moved / seconds / 1e9 if seconds else 0:>6.2f}  {match}"
                    )
                    text = str(tok.decode(answer, skip_special_tokens=True)).strip()
                    print(f"      assistant: {text!r}")
                    messages.append({"role": "assistant", "content": text})
        finally:
            store.send_signal(signal.SIGTERM)
            store.wait(60)
    print("\ntokens match recomputing on every turn" if all_match else "\nTOKENS DIFFER on some turn")
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
