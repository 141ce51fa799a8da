"""Prefill worker: computes a prompt's KV blocks and writes them to the store (see prefill_node.service)."""
