"""deepspeed.utils: zero_to_fp32's functions over zero's checkpoints, the
stage-3 leaf-module marks (set_z3_leaf_modules and its companions), and
the readers of a parameter's fp32 values and optimizer states
(safe_get_full_fp32_param and its companions: _safe_access.py)."""
from zero.deepspeed.utils import zero_to_fp32
from zero.deepspeed.utils._safe_access import (safe_get_full_fp32_param,
                                                safe_get_full_optimizer_state,
                                                safe_get_local_fp32_param,
                                                safe_get_local_optimizer_state)
from zero.deepspeed.utils._leaf_modules import (get_z3_leaf_modules, set_z3_leaf_modules,
                                                 unset_z3_leaf_modules, z3_leaf_module)

__all__ = ["zero_to_fp32", "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module",
           "get_z3_leaf_modules", "safe_get_full_fp32_param", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_optimizer_state"]
