"""Tensor parallelism: an engine's ranks, one per device, each running the same forward on its
shard of the model (`group.py`: the process group and its collectives; `ranks.py`: rank 0's
side, which starts the other ranks and sends them every step; `shard_main.py`: a rank's
process; `executor.py`: what every rank runs; `host_shards.py`: the host tier's copies on
every rank; `kv_heads.py`: whole KV heads for snapshots)."""
