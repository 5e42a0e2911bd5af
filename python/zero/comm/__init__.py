"""comm: the one door to torch.distributed; every collective names its group."""
