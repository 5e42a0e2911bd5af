"""zero.checkpoint: a checkpoint of engine.save_checkpoint as plain torch
state dicts, with no engine, no process group and any number of processes
(one is enough):

    from zero.checkpoint import consolidate
    state = consolidate("ckpt/")              # the tag in ckpt/latest
    model.load_state_dict(state["model"])     # fp32, every key of the model
    optimizer.load_state_dict(state["optimizer"])  # a torch.optim optimizer

or from a shell, the model's fp32 state dict alone:

    python -m zero.checkpoint ckpt/ model.pt [--tag TAG] [--with-optimizer]

A DeepSpeed run comes across with convert_deepspeed(ds_dir, out_dir,
trust_pickle=True), or from a shell:

    python -m zero.checkpoint.from_deepspeed DS_DIR OUT_DIR --trust-pickle
"""
from zero.checkpoint._consolidate import consolidate
from zero.checkpoint._from_deepspeed import convert_deepspeed

__all__ = ["consolidate", "convert_deepspeed"]
