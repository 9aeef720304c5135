"""Tensor parallelism: the process group and its collectives (distributed), the one sharding
table (layout), the local modules that run it (modules), and the FSDP path of the seed's
converter (fsdp, converter)."""
