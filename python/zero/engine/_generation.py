"""engine.generate: generation inside training at inference speed (the
hybrid engine of DeepSpeed-Chat).

[Note: generation]
- At stage 3 every forward gathers each unit with a collective and
  releases it after, so a generation of n tokens gathers the model n times
  (and every rank must run as many forwards: synced_gpus). engine.generate
  gathers every parameter once (zero.GatheredParameters over the whole
  model), sets the schedule's hooks aside (Stage3Schedule.suspended), runs
  the model's own generate (HuggingFace's, with its KV cache) or the
  caller's function, and releases everything after. No collective runs in
  between, so ranks may stop at different lengths without synced_gpus.
- The gathered model must fit in the device's memory beside the training
  states (the whole model, in the compute dtype). A model that does not
  fit generates through engine.module.generate(..., synced_gpus=True),
  unit by unit.
- Stages 0-2 hold the whole model already: generate runs as it is.
- Generation runs without gradients; training goes on afterwards with
  nothing changed (tests/test_engine_generate.py: train, generate, train equals
  train, train).
"""
from __future__ import annotations

import contextlib

import torch

from zero.sharding._gathered import GatheredParameters


def generate(engine, args, kwargs, generate_fn=None):
    """generate_fn(module, *args, **kwargs), or module.generate(*args,
    **kwargs), with every parameter gathered once and no gradients."""
    module = engine.module
    if generate_fn is None:
        generate_fn = getattr(type(module), "generate", None)
        if generate_fn is None:
            raise TypeError(f"engine.generate: {type(module).__name__} has no generate method "
                            "(a HuggingFace model has one); pass generate_fn=f, called as "
                            "f(model, *args, **kwargs)")
    schedule = engine._schedule
    with torch.no_grad():
        if schedule is None:  # stages 0-2: gathered for good
            return generate_fn(module, *args, **kwargs)
        with GatheredParameters(list(module.parameters())), _suspended(schedule):
            return generate_fn(module, *args, **kwargs)


@contextlib.contextmanager
def _suspended(schedule):
    schedule.suspended = True
    try:
        yield
    finally:
        schedule.suspended = False
