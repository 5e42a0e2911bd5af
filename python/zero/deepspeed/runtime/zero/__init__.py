"""deepspeed.runtime.zero: see partition_parameters."""
