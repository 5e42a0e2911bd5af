"""deepspeed.runtime: the module paths scripts written for DeepSpeed import
names from (deepspeed.runtime.zero.partition_parameters)."""
