"""deepspeed.runtime.engine: DeepSpeedEngine is zero's Engine, the class
deepspeed.initialize returns here (isinstance checks in scripts and
libraries that unwrap a model hold)."""
from zero.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
