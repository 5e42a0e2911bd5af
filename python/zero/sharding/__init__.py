"""sharding: one mechanism for stages 0-3: the flat layout of parameters in
units, the bucket reducer, the stage-3 schedule of gathers and releases,
gathered parameters and partitioned construction."""
