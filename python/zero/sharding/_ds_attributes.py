"""DeepSpeed's attributes on a stage-3 parameter: `ds_id`, `ds_numel`,
`ds_shape`, `ds_persist` and `ds_status`.

[Note: DeepSpeed's parameter attributes] Code written for DeepSpeed's
ZeRO-3 finds partitioned parameters by these names and gathers them
itself: DeepSpeed-Chat's save and EMA update (hasattr(p, "ds_id") and
p.ds_status == ZeroParamStatus.NOT_AVAILABLE, then GatheredParameters),
PEFT's layer shapes and parameter counts (ds_shape, ds_numel), TRL. Without
them such code took a released parameter's placeholder (shape (0,)) for
its weight: DeepSpeed-Chat's save wrote empty tensors without a word, and
its EMA update failed on a shape mismatch that named neither. The values
mean what DeepSpeed's do: the id is unique in the process, numel and
shape are the whole parameter's, ds_persist says the unit stays gathered,
and ds_status follows the unit (AVAILABLE while gathered, NOT_AVAILABLE
when released; a prefetch in flight stays NOT_AVAILABLE until it is
waited for). They are marks ([Note: marks not pickled]): a pickled
parameter carries none, and close() takes them off.
"""
from __future__ import annotations

import enum
import itertools

import torch

from zero.sharding._param_marks import DEEPSPEED_MARKS, mark, unmark


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's names and values (deepspeed.runtime.zero.partition_parameters).
    A member equals DeepSpeed's own member of the same name too: a script
    ported by its `import deepspeed` line alone, on a machine where
    DeepSpeed is installed, still compares p.ds_status with DeepSpeed's
    enum (DeepSpeed-Chat's save then found nothing to gather)."""
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3

    def __eq__(self, other):
        return self is other or (type(other).__name__ == "ZeroParamStatus" and
                                 isinstance(other, enum.Enum) and other.name == self.name)

    def __hash__(self):
        return hash(self.name)


AVAILABLE, NOT_AVAILABLE = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE

_next_id = itertools.count()


def mark_partitioned(groups) -> None:
    """Give every parameter of stage 3's units (every group's, frozen
    ones too) DeepSpeed's attributes; the units keep ds_status current."""
    for fg in groups:
        for unit in fg.units:
            status = AVAILABLE if unit.gathered and unit.work is None else NOT_AVAILABLE
            for p, numel, shape in zip(unit.params, unit.numels, unit.shapes):
                mark(p, "ds_id", next(_next_id))
                mark(p, "ds_numel", numel)
                mark(p, "ds_shape", torch.Size(shape))
                mark(p, "ds_persist", unit.persistent)
                mark(p, "ds_status", status)
            unit.says_status = True


def unmark_partitioned(groups) -> None:
    for fg in groups:
        for unit in fg.units:
            unit.says_status = False
            for p in unit.params:
                for name in DEEPSPEED_MARKS:
                    unmark(p, name)
