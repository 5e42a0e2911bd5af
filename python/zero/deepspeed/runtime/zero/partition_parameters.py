"""deepspeed.runtime.zero.partition_parameters: the names scripts written
for DeepSpeed's ZeRO-3 import from here (DeepSpeed-Chat's ZeroParamStatus,
to find released parameters by `p.ds_status`; [Note: DeepSpeed's parameter
attributes] in sharding/_ds_attributes.py), and Init and
GatheredParameters and register_external_parameter (defined here in
DeepSpeed), which deepspeed.zero also has."""
from zero.deepspeed.zero import (GatheredParameters, Init,  # noqa: F401
                                 register_external_parameter, unregister_external_parameter)
from zero.sharding._ds_attributes import ZeroParamStatus  # noqa: F401

__all__ = ["ZeroParamStatus", "GatheredParameters", "Init", "register_external_parameter",
           "unregister_external_parameter"]
