"""The client ends of the data lanes (see kvstore/lanes/__init__.py); imported by kvstore.node_client."""
