"""What a ZeRO stage is, as one frozen object built once from the user's
`stage`: the stages are settings of one sharding mechanism (DESIGN.md),
and the code asks the setting it means ("are gradients reduced during
backward?") rather than comparing stage numbers.

    stage  states   gradients  parameters  reduction        parameters released
    0      whole    whole      whole       at the boundary  never
    1      split    whole      whole       at the boundary  never
    2      split    split      whole       during backward  never
    3      split    split      split       during backward  after each use
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    stage: int
    partitions_states: bool    # optimizer states (and the fp32 master) split over dp_shard
    partitions_grads: bool     # only this rank's chunk of the gradients is kept
    partitions_params: bool    # parameters live as shards, gathered per unit for use
    reduces_in_backward: bool  # buckets reduced from hooks as backward runs (else at the boundary)
    releases_params: bool      # a unit's gathered parameters are dropped after use

    @classmethod
    def of(cls, stage: int) -> "StagePolicy":
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
        return cls(stage=stage, partitions_states=stage >= 1, partitions_grads=stage >= 2,
                   partitions_params=stage == 3, reduces_in_backward=stage >= 2,
                   releases_params=stage == 3)

    @property
    def partitions(self) -> bool:
        """Whether anything is split over the ranks (stage 0 is DDP)."""
        return self.partitions_states
