"""deepspeed.utils: zero_to_fp32's functions over zero's checkpoints, and
the stage-3 leaf-module marks (set_z3_leaf_modules and its companions)."""
from zero.deepspeed.utils import zero_to_fp32
from zero.deepspeed.utils._leaf_modules import (get_z3_leaf_modules, set_z3_leaf_modules,
                                                 unset_z3_leaf_modules, z3_leaf_module)

__all__ = ["zero_to_fp32", "set_z3_leaf_modules", "unset_z3_leaf_modules", "z3_leaf_module",
           "get_z3_leaf_modules"]
