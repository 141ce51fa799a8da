"""Decode worker: fetches a prompt's cached KV from the store and generates (see decode_node.engine)."""
