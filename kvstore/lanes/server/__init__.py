"""The server ends of the data lanes (see kvstore/lanes/__init__.py); wired into kvstore serve by ``wiring.LaneServer``."""
