"""The demo chat both demos play (``kvstore demo``, built-in workers or vLLM): one shared system prompt and
the user's turns."""

SYSTEM = (
    "You are a concise assistant for a team that runs a large language model service. "
    "The service splits inference into prefill workers, which read the whole prompt, and decode "
    "workers, which write the answer one token at a time. Between them sits a key-value cache store "
    "that keeps the attention keys and values of every prompt prefix it has seen, in GPU memory, host "
    "memory and on NVMe drives, so that a later request sharing the prefix does not recompute it. "
)
TURNS = (
    "In one sentence: why does a shared system prompt make the cache store useful?",
    "And what happens when the store is full?",
    "Give one number that shows it works.",
)
