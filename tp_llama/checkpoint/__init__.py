"""Meta's consolidated checkpoints: params.json (params), the shard files (shards), this rank's
slices read from them (reader), and the model built on what was read (loader)."""
