"""zero.checkpoint: a checkpoint of engine.save_checkpoint as plain torch
state dicts, with no engine, no process group and any number of processes
(one is enough):

    from zero.checkpoint import consolidate
    state = consolidate("ckpt/")              # the tag in ckpt/latest
    model.load_state_dict(state["model"])     # fp32, every key of the model
    optimizer.load_state_dict(state["optimizer"])  # a torch.optim optimizer

or from a shell, the model's fp32 state dict alone:

    python -m zero.checkpoint ckpt/ model.pt [--tag TAG] [--with-optimizer]
"""
from zero.checkpoint._consolidate import consolidate

__all__ = ["consolidate"]
