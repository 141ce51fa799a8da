"""The words of the shared DRAM index's file (described in ``kvstore/arena_index.py``), for its writer, its
readers and its compiled probe alike."""

import functools

MAGIC = 0x6B7673746F726569  # "kvstorei"
VERSION = 2  # 2: an entry's offset may name a record of an NVMe segment file (ON_DISK)
HEADER_WORDS = 8  # MAGIC, VERSION, buckets, ways, then spare words
ENTRY_WORDS = 5
SEQ, KEY0, KEY1, OFFSET, LENCRC = range(ENTRY_WORDS)
WAYS = 8

# An offset word with ON_DISK set names a payload in the NVMe tier's files, not in the arena: the segment's id
# in the bits above SEGMENT_SHIFT, the payload's byte offset in that file below them.
ON_DISK = 1 << 63
SEGMENT_SHIFT = 40
SEGMENT_IDS = (1 << (63 - SEGMENT_SHIFT)) - 1
FILE_OFFSETS = (1 << SEGMENT_SHIFT) - 1
SEGMENT_FILE = "seg-{:010d}.log"  # the NVMe tier's segment file names (kvstore/tiers/nvme/segments.py)


def disk_word(segment_id: int, file_offset: int) -> int:
    if not 0 <= segment_id <= SEGMENT_IDS or not 0 <= file_offset <= FILE_OFFSETS:
        raise ValueError(f"segment {segment_id} offset {file_offset} does not fit an index entry")
    return ON_DISK | segment_id << SEGMENT_SHIFT | file_offset


@functools.lru_cache(maxsize=1024)
def segment_name(segment_id: int) -> str:
    return SEGMENT_FILE.format(segment_id)  # formatted once per segment, not once per block of every Get


def segment_file(word: int) -> tuple[str, int]:
    """(file name, payload offset) of an ON_DISK offset word."""
    return segment_name((word >> SEGMENT_SHIFT) & SEGMENT_IDS), word & FILE_OFFSETS
