"""The words of the shared DRAM index's file (described in ``kvstore/arena_index.py``), for its writer, its
readers and its compiled probe alike."""

MAGIC = 0x6B7673746F726569  # "kvstorei"
VERSION = 1
HEADER_WORDS = 8  # MAGIC, VERSION, buckets, ways, then spare words
ENTRY_WORDS = 5
SEQ, KEY0, KEY1, OFFSET, LENCRC = range(ENTRY_WORDS)
WAYS = 8
