"""Generated gRPC stubs for kvstore.v1 (regenerate with `python -m kvstore.genproto`)."""
