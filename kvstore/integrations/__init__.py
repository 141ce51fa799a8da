"""Inference-engine integrations: ``kvstore.integrations.vllm`` (a vLLM v1 KV connector)."""
