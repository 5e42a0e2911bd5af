"""deepspeed.utils: zero_to_fp32's functions over zero's checkpoints, the
stage-3 leaf-module marks (set_z3_leaf_modules and its companions), and
the readers and writers of a parameter's fp32 values and optimizer states
(safe_get_full_fp32_param and its companions: _safe_access.py;
safe_set_full_fp32_param and its companions: _safe_writes.py) and
gradients (safe_get_full_grad and its companions: _safe_grads.py); the
logger and log_dist, RepeatingLoader and OnDevice."""
from zero.deepspeed.utils import zero_to_fp32
from zero.deepspeed.utils._loaders import RepeatingLoader
from zero.deepspeed.utils._logging import (get_current_level, log_dist, log_dist_once,
                                           logger, set_log_level_from_string)
from zero.deepspeed.utils._on_device import OnDevice
from zero.deepspeed.utils._safe_access import (safe_get_full_fp32_param,
                                                safe_get_full_optimizer_state,
                                                safe_get_local_fp32_param,
                                                safe_get_local_optimizer_state)
from zero.deepspeed.utils._safe_grads import (safe_get_full_grad, safe_get_local_grad,
                                               safe_set_full_grad, safe_set_local_grad)
from zero.deepspeed.utils._safe_writes import (safe_set_full_fp32_param,
                                                safe_set_full_optimizer_state,
                                                safe_set_local_fp32_param,
                                                safe_set_local_optimizer_state)
from zero.deepspeed.utils._leaf_modules import (get_z3_leaf_modules, set_z3_leaf_modules,
                                                 unset_z3_leaf_modules, z3_leaf_module)

__all__ = ["zero_to_fp32", "logger", "log_dist", "log_dist_once", "set_log_level_from_string",
           "get_current_level", "RepeatingLoader", "OnDevice", "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module",
           "get_z3_leaf_modules", "safe_get_full_fp32_param", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_optimizer_state",
           "safe_get_full_grad", "safe_get_local_grad", "safe_set_full_grad",
           "safe_set_local_grad"]
