"""deepspeed.runtime.zero.partition_parameters: the names scripts written
for DeepSpeed's ZeRO-3 import from here (DeepSpeed-Chat's ZeroParamStatus,
to find released parameters by `p.ds_status`; [Note: DeepSpeed's parameter
attributes] in sharding/_ds_attributes.py), and Init and
GatheredParameters, which deepspeed.zero also has."""
from zero.deepspeed.zero import GatheredParameters, Init  # noqa: F401
from zero.sharding._ds_attributes import ZeroParamStatus  # noqa: F401

__all__ = ["ZeroParamStatus", "GatheredParameters", "Init"]
