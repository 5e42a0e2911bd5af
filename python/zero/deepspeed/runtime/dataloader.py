"""deepspeed.runtime.dataloader: RepeatingLoader (also in
deepspeed.utils), a loader started again at its end."""
from zero.deepspeed.utils._loaders import RepeatingLoader

__all__ = ["RepeatingLoader"]
