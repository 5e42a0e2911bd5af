"""parallel: the mesh a user passes, turned into the groups zero's
collectives use (dp_replicate, dp_shard; later tp, pp)."""
