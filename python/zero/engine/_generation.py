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
  states (the whole model, in the compute dtype). gather="auto" (the
  default) checks: when the whole model would take more than half the
  device's free memory (CUDA's mem_get_info; the CPU's MemAvailable), it
  generates unit by unit instead (gather="units"): the schedule's hooks
  gather each block as it runs, prefetching the next, and release it
  after, for every token (ZeRO-Inference's streaming, from host memory or
  files under offload_param). Each forward then runs collectives, so
  every rank must run as many: HuggingFace's generate gets
  synced_gpus=True on more than one rank (a generate_fn must keep the
  ranks in step itself). gather="whole" or "units" forces a choice.
- Stages 0-2 hold the whole model already: generate runs as it is.
- Generation runs without gradients; training goes on afterwards with
  nothing changed (tests/test_engine_generate.py: train, generate, train equals
  train, train). So the whole gather lands nothing: with
  offload_optimizer.delayed_update, the update in flight stays in flight,
  and generation sees the parameters the next forward would (those the
  hooks gather with gather="units"); zero.GatheredParameters would land
  it, a step early for the training after.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import weakref

import torch

from zero.sharding._gathered import GatheredParameters
from zero.sharding._step_agreement import agree_on_call


GATHERS = ("auto", "whole", "units")


def available_memory(device: torch.device) -> int:
    """Free bytes of the device's memory (CUDA), or the machine's
    available memory (the CPU; /proc/meminfo's MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def whole_fits(engine) -> bool:
    """Whether gathering the whole model takes at most half the free memory."""
    # the flat groups know the whole sizes (released parameters are empty)
    needed = sum(fg.numel for fg in engine.all_groups) * engine.compute_dtype.itemsize
    return 2 * needed <= available_memory(engine.device)


def generate(engine, args, kwargs, generate_fn=None, gather="auto"):
    """generate_fn(module, *args, **kwargs), or module.generate(*args,
    **kwargs), without gradients; at stage 3 with every parameter gathered
    once ("whole") or unit by unit for each forward ("units"), "auto"
    choosing by the free memory ([Note: generation])."""
    if gather not in GATHERS:
        raise ValueError(f"engine.generate: gather={gather!r}; choose one of {GATHERS}")
    module = engine.module
    schedule = engine._schedule
    units = schedule is not None and (gather == "units" or
                                      gather == "auto" and not _whole_fits_everywhere(engine))
    if schedule is not None and gather != "auto" and engine._comm.everyone.world > 1:
        _agree_on_generate(engine, False, gather)
    assistant = _assistant_engine(kwargs)
    if units and "assistant_model" in kwargs and engine._comm.everyone.world > 1:
        # unit by unit the ranks must stay in step (synced_gpus), and
        # HuggingFace's synced loop fails with assisted decoding on the rank
        # that finishes first (a plain model too: max_new_tokens -1)
        raise ValueError(
            "engine.generate(assistant_model=...) unit by unit on several ranks: every rank "
            "must then run as many forwards (synced_gpus), and HuggingFace's assisted "
            "decoding fails in that loop on the rank that finishes first. Gather the model "
            "whole (gather=\"whole\", which needs it to fit), or generate without the "
            "assistant")
    if generate_fn is None:
        generate_fn = own_generate(type(module))  # not the route back here
        if generate_fn is None:
            raise TypeError(f"engine.generate: {type(module).__name__} has no generate method "
                            "(a HuggingFace model has one); pass generate_fn=f, called as "
                            "f(model, *args, **kwargs)")
        if units and engine._comm.everyone.world > 1:
            kwargs.setdefault("synced_gpus", True)  # each forward gathers with collectives
        elif schedule is not None and _takes_synced_gpus(module, generate_fn):
            # gathered whole: no collective in the loop, so ranks stop apart.
            # HF's generate would sync by itself at stage 3 on several ranks
            # (the modules carry FSDP's marks: [Note: every rank runs every
            # layer]): an all-reduce a token, and without a cache its synced
            # loop failed on a rank that finished first
            kwargs.setdefault("synced_gpus", False)
    # a stage-3 assistant (assisted decoding's draft model) is gathered whole
    # whatever the main model's way: its forwards gathered with collectives,
    # and ranks that stopped apart ran different numbers of them (the longer
    # waited for good, or gloo aborted on the sizes)
    drafting = gathered_whole(assistant) if assistant is not None else contextlib.nullcontext()
    with torch.no_grad(), drafting:
        if schedule is None or units:  # gathered for good (stages 0-2), or by the hooks
            return generate_fn(module, *args, **kwargs)
        with gathered_whole(engine):
            return generate_fn(module, *args, **kwargs)


def _assistant_engine(kwargs):
    """HF's assisted decoding takes a draft model as `assistant_model`: an
    engine given there becomes its model (HF reads the model's config);
    returns the stage-3 engine that partitions the draft, if any."""
    assistant = kwargs.get("assistant_model")
    if assistant is None:
        return None
    owner = None
    if hasattr(assistant, "_schedule") and isinstance(getattr(assistant, "module", None),
                                                      torch.nn.Module):
        owner, kwargs["assistant_model"] = assistant, assistant.module
    elif isinstance(assistant, torch.nn.Module):
        place = next((p.__dict__.get("_zero_place") for p in assistant.parameters()), None)
        owner = place.engine() if place is not None else None
    return owner if owner is not None and owner._schedule is not None else None


def gathers_whole(engine) -> bool:
    """gather="auto"'s choice at stage 3, agreed by every rank (a
    collective): whether the whole model fits gathered on each."""
    return _whole_fits_everywhere(engine)


@contextlib.contextmanager
def gathered_whole(engine):
    """Every parameter gathered once and the schedule's hooks set aside
    (engine.generate's whole-model way), for a caller that runs the
    model's generate itself: the HF trainer's prediction_step."""
    with _GatheredForGeneration(list(engine.module.parameters())), \
            _suspended(engine._schedule):
        yield


def _takes_synced_gpus(module, generate_fn) -> bool:
    """Whether the model's generate takes HF's synced_gpus: named, or
    through **kwargs of a wrapper that hands them to a HuggingFace model's
    (PEFT's generate(*args, **kwargs), TRL's value-head models)."""
    try:
        params = inspect.signature(generate_fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return False
    if "synced_gpus" in params:
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) and \
        _wraps_hf_generation(module)


def _wraps_hf_generation(module) -> bool:
    base = getattr(module, "get_base_model", None)  # PEFT's
    inner = [module, base() if callable(base) else None,
             getattr(module, "pretrained_model", None)]  # TRL's value heads
    return any(m is not None and any(c.__name__ == "GenerationMixin" and
                                     c.__module__.startswith("transformers")
                                     for c in type(m).__mro__) for m in inner)


class _GatheredForGeneration(GatheredParameters):
    """GatheredParameters that reads the parameters as the next forward
    would: nothing written or pending is taken in ([Note: generation])."""

    def _take_in_writes(self):
        pass


def _whole_fits_everywhere(engine) -> bool:
    """whole_fits on every rank (they must all gather the same way)."""
    fits = whole_fits(engine)
    return _agree_on_generate(engine, not fits, "auto") == 0 and fits


def _agree_on_generate(engine, refused: bool, gather: str) -> int:
    """At stage 3 generation gathers with collectives: a generate() on some
    ranks only (rank 0 alone, after training) met the others' next call
    and aborted in gloo or waited out the timeout. Agreed first, as every
    collective engine call is ([Note: writes agreed]); how many other
    ranks refused (here: lack the memory to gather the whole model)."""
    return agree_on_call(engine._comm.everyone, engine.call_text(f"generate(gather={gather!r})"),
                         refused)


@contextlib.contextmanager
def _suspended(schedule):
    schedule.suspended = True
    try:
        yield
    finally:
        schedule.suspended = False


# stage-3 root modules whose generate goes through their engine, to it (weakly)
_ROUTED = weakref.WeakKeyDictionary()


def route_generate(engine):
    """[Note: the model's own generate at stage 3] A HuggingFace user calls
    model.generate(...), not engine.generate: at stage 3 on several ranks
    that ran HF's synced loop, an all-reduce a token on the default group
    beside a gather a unit a token. Called on rank 0 alone (a sample
    printed after training) its first all-reduce met the other ranks' next
    engine call: gloo aborted on the sizes, or both waited out the timeout.
    So the model's generate goes through engine.generate: agreed first (a
    rank alone is refused on every rank, by name), gathered once.
    The route is a registry entry (the module, weakly) and a wrapper on the
    model's class that reads it, not an attribute on the model: a copy
    (copy.deepcopy inside zero.GatheredParameters, TRL's reference model)
    or a pickle is a plain model with the class's generate, never one that
    generates from the original. Modules not routed, a closed or dropped
    engine, and a whole gather already in force (engine.generate's own,
    the HF trainer's prediction_step) get the class's generate as it was."""
    module = engine.module
    cls = type(module)
    present = getattr(cls, "generate", None)
    if engine._schedule is None or present is None or "generate" in module.__dict__:
        return  # stages 0-2 hold the model whole; a generate set on the model is kept
    _ROUTED[module] = weakref.ref(engine)
    if getattr(present, "_zero_original", None) is not None:
        return  # this class (or a base) already reads the registry

    def generate_routed(self, *args, **kwargs):
        ref = _ROUTED.get(self)
        live = ref() if ref is not None else None
        if live is None or live._closed or live._schedule is None or \
                live._schedule.suspended:
            return present(self, *args, **kwargs)
        return generate(live, args, kwargs)
    functools.update_wrapper(generate_routed, present)
    generate_routed._zero_original = present
    cls.generate = generate_routed


def unroute_generate(module):
    """close(): the model's generate is its class's again (the class's
    wrapper stays, reading no entry for it)."""
    _ROUTED.pop(module, None)


def own_generate(cls):
    """The class's generate, under the route's wrapper if it has one."""
    found = getattr(cls, "generate", None)
    return getattr(found, "_zero_original", found)
