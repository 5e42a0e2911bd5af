"""deepspeed.runtime.zero: ZeroParamStatus and the names of
partition_parameters, where DeepSpeed-Chat's helpers import them from."""
from zero.deepspeed.runtime.zero.partition_parameters import (GatheredParameters, Init,
                                                              ZeroParamStatus)

__all__ = ["ZeroParamStatus", "GatheredParameters", "Init"]
