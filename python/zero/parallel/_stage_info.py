"""What a pipeline stage module (split_gpt / split_llama, or a rank's
several stages) tells the engine: its place and its tied copies ([Note:
pipeline stages] in _pipeline.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StageInfo:
    """What a stage module made by split_gpt / split_llama tells the
    engine: its place, its tied copies (its parameter name -> the name of
    the parameter it copies, which the first stage holds), and the names
    of the model's parameters tied across stages (the same on every
    stage, so all take part in their sums)."""
    index: int
    count: int
    ties: dict = field(default_factory=dict)
    tied: tuple = ()
