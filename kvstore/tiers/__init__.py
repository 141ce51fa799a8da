"""Storage tiers: memory arenas (HBM, DRAM) and the NVMe segment log, behind kvstore.tiers.base."""
