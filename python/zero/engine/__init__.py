"""zero.engine: the Engine a model is wrapped in by zero.initialize, and the
API around it (initialize, estimate_memory, memory and DeepSpeed-style
queries, what the engine sets on the user's objects)."""
from zero.engine._engine import Engine

__all__ = ["Engine"]
