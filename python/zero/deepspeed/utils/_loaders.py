"""deepspeed.utils.RepeatingLoader: iterate a data loader for good, taking
it from the start again at its end (DeepSpeed's pipeline scripts wrap
their loaders so: `train_batch(data_iter=RepeatingLoader(loader))`). A
loader with a DistributedSampler gets no new epoch on the way round, as
under DeepSpeed: call loader.sampler.set_epoch yourself to reshuffle."""
from __future__ import annotations


class RepeatingLoader:
    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            # an empty loader raises StopIteration here too: nothing to repeat
            return next(self.data_iter)
