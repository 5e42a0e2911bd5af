"""What zero.initialize and estimate_memory work out about a model before
any buffer exists: which parameters train in which optimizer group, the
units stage 3 makes of them, the files offload puts them in, and rank 0's
values of what is not partitioned."""
from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _NormBase

from zero._warnings import warn_user
from zero.sharding._partitioned_init import sharded_record, take_values
from zero.sharding._shared_memory import first_shared_pair, memory_span, shared_memory_error
from zero.sharding._units import parameter_names


def offload_files(offload, comm):
    """group index -> the NvmeFiles its states live in (None: in memory,
    the host's for a staged GPU model)."""
    if offload.device != "nvme":
        return lambda index: None
    from zero.offload._nvme import NvmeFiles
    return lambda index: NvmeFiles(offload.nvme_path, f"r{comm.global_rank}-g{index}",
                                   offload.chunk_elements, offload.write_through)

def apply_aio(aio, *offloads):
    """The config's aio block (block_size, queue_depth) on the disk engine
    (process-wide), when one of the offload blocks goes to a disk."""
    if aio and any(o.device == "nvme" for o in offloads):
        from zero.offload._aio import set_io
        set_io(**aio)


def param_files(offload, chunk_elements, comm):
    """group index -> the NvmeFiles its stage-3 shard lives in (None: in
    memory). offload_param "cpu" changes nothing for a CPU model, the
    only kind it is accepted for (initialize). The step writes the
    shard chunk by chunk, offload_optimizer's chunk_elements at a time."""
    if offload.device != "nvme":
        return lambda index: None
    from zero.offload._nvme import NvmeFiles
    return lambda index: NvmeFiles(offload.nvme_path, f"r{comm.global_rank}-g{index}-params",
                                   chunk_elements, what="offload_param")

def owners_of(module, roots):
    """Parameter id -> (index of the module whose unit holds it, the
    index of the first module that registers it, its place there):
    stage 3 makes one unit of all the parameters below each unit root
    (roots: a _unit_roots.UnitRoots), and one of each other module's own."""
    modules = list(module.modules())
    position = {id(m): i for i, m in enumerate(modules)}
    owners = {}
    for m_index, m in enumerate(modules):
        root = roots.root(m)
        unit_index = position[id(root)] if root is not None else m_index
        for p_index, p in enumerate(m._parameters.values()):
            if p is not None and id(p) not in owners:
                owners[id(p)] = (unit_index, m_index, p_index)
    return owners

def units_of(params, owners):
    """Index lists of params, one per owning module, in module order."""
    if owners is None:
        return None
    order = sorted(range(len(params)), key=lambda i: owners[id(params[i])])
    units = []
    for i in order:
        if units and owners[id(params[units[-1][0]])][0] == owners[id(params[i])][0]:
            units[-1].append(i)
        else:
            units.append([i])
    return units

def match_param_groups(module, optimizer):
    """The optimizer's groups as (params, names), trainable params only,
    each once; every trainable parameter must be in a group."""
    names = parameter_names(module)
    seen = {}  # id(trainable parameter) -> the index of its group
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        params, pnames = [], []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"param group {gi} of the optimizer holds a parameter of "
                                 f"shape {tuple(p.shape)} that is not in the model")
            if not p.requires_grad:
                continue
            if id(p) in seen:
                # torch.optim updates it once per listing (each with its
                # group's settings); one flat copy can take one update only
                where = f"twice in param group {gi}" if seen[id(p)] == gi else \
                    f"in param groups {seen[id(p)]} and {gi}"
                raise ValueError(f"parameter '{names[id(p)]}' is listed {where} of the "
                                 "optimizer (torch.optim would update it once per listing); "
                                 "list each parameter in one group, once")
            if torch._debug_has_internal_overlap(p) == 1 and sharded_record(p) is None:
                # torch.optim refuses it (an update would write one memory
                # location for several elements); a flat buffer gave each
                # element its own value, and the elements trained apart
                raise ValueError(f"parameter '{names[id(p)]}' has elements that share memory "
                                 f"(an expanded tensor, strides {tuple(p.stride())}); "
                                 "torch's optimizers refuse it too. Register "
                                 "nn.Parameter(t.contiguous()) instead, or expand it in "
                                 "forward")
            seen[id(p)] = gi
            params.append(p)
            pnames.append(names[id(p)])
        groups.append((params, pnames))
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            raise ValueError(f"parameter '{name}' requires grad but is in none of the "
                             "optimizer's param groups; add it, or set requires_grad=False")
    shared = first_shared_pair((f"parameter '{name}'", memory_span(p))
                               for name, p in module.named_parameters())
    if shared is not None:
        raise shared_memory_error(*shared, "Tie them as one Parameter (model.b = model.a)")
    return groups


def broadcast_buffer(comm, name, buf, kind="buffer"):
    """Rank 0's value of a buffer on every rank. The collective writes
    numel x itemsize bytes from the data pointer, so a buffer that is not
    contiguous goes through a contiguous copy; one whose elements share
    memory (an expanded tensor) cannot take a value per element at all."""
    comm = comm.everyone  # the replicas take rank 0's value too
    if comm.world == 1:
        return
    _refuse_shared_elements(name, buf, kind)
    if buf.is_contiguous():
        comm.broadcast(buf, src=0)
        return
    staged = buf.contiguous()
    comm.broadcast(staged, src=0)
    buf.copy_(staged)


def _refuse_shared_elements(name, tensor, kind):
    if torch._debug_has_internal_overlap(tensor) == 1:
        raise ValueError(f"{kind} '{name}' has elements that share memory (an expanded "
                         f"tensor, strides {tuple(tensor.stride())}), so rank 0's value (or a "
                         "checkpoint's) cannot be written into it; register its "
                         ".contiguous() (or .clone()) instead")


def refuse_shared_element_buffers(module):
    """Every buffer whose elements share memory, refused before initialize
    changes the model, in one process too: a checkpoint's values cannot be
    written into it either (load_checkpoint failed there on torch's unnamed
    error, after the parameters had taken the checkpoint's values). With
    several ranks broadcast_buffer refuses it too, and a frozen parameter
    of the kind (which one process keeps as it is)."""
    for name, buf in module.named_buffers():
        _refuse_shared_elements(name, buf, "buffer")


def cast_module(module, dtype, device, policy, buffer_dtype=None):
    """module.to(device), the parameters outside the flat groups cast to
    the compute dtype `dtype`, leaving the parameters the flat groups take
    as they are: a group reads them one unit at a time, casts them and
    puts them where its shard lives (the host, under offload_param for a
    GPU model, whose device may not hold the whole model), and a
    partitioned_init placeholder cast here would be allocated in full.
    Where frozen parameters are not in a flat group (stages 0-2), a frozen
    placeholder is gathered here. Buffers: [Note: buffer dtypes]."""
    statistics = {id(b) for m in module.modules() if isinstance(m, _NormBase)
                  for b in m.buffers(recurse=False)}

    def cast(t):
        if sharded_record(t) is not None:
            if policy.partitions_params or t.requires_grad:
                return t
            return take_values(t).to(device=device, dtype=dtype)
        if not isinstance(t, torch.nn.Parameter):
            return t.to(device=device, dtype=_buffer_dtype(t, dtype, buffer_dtype,
                                                           id(t) in statistics))
        if t.is_floating_point() and (t.requires_grad or policy.partitions_params):
            # a flat group's: it reads the values as they are, so an fp32
            # model's master weights start exact, not rounded to the
            # compute dtype ([Note: dtypes given back] in _handback.py)
            return t
        return t.to(device=device, dtype=dtype if t.is_floating_point() else None)
    module._apply(cast)


# [Note: buffer dtypes]
# A floating buffer keeps its dtype in a bf16/fp16 engine, as DeepSpeed 0.19
# ("cast params only"), FSDP2 and an HF model run under autocast keep it:
# a RoPE inv_freq made in fp32 so that position 4000's angle stays exact
# computes in fp32, and a float64 accumulator stays float64. Two exceptions:
# - the running statistics of a batch or instance norm follow the compute
#   dtype, because torch's kernels want them in the weight's dtype (a bf16
#   weight beside fp32 running_mean is refused on the CPU: "expected scalar
#   type BFloat16 but found Float"; DeepSpeed 0.19 fails there);
# - buffer_dtype (DeepSpeed's data_types.buffer_dtype) casts every other
#   floating buffer to the dtype it names.
# zero until 2026-12-07 cast every floating buffer to the compute dtype, as
# DeepSpeed < 0.19's module.bfloat16() did; a checkpoint saved then holds
# bf16 buffers, which load_state_dict copies into the fp32 ones.
def kept_buffers(module, dtype) -> list:
    """The names of the floating buffers a 16-bit engine left in another
    dtype than its own (empty in an fp32 engine)."""
    if dtype.itemsize != 2:
        return []
    return [name for name, b in module.named_buffers()
            if b.is_floating_point() and b.dtype != dtype]


# torch's words for operands of two floating dtypes in one op
_MIXED_DTYPE_WORDS = ("mixed dtype", "expected scalar type", "same dtype",
                      "expected both inputs", "found float", "found bfloat16", "found half")


def note_kept_buffers(error, kept: list, dtype):
    """[Note: buffer dtypes] A forward that mixes an fp32 buffer into 16-bit
    activations fails in torch's words (M2M100's and XGLM's position tables
    before a bf16 LayerNorm: "mixed dtype (CPU): expect parameter to have
    scalar type of Float", as under DeepSpeed 0.19): the note names the
    buffers and buffer_dtype."""
    if not kept or not any(word in str(error).lower() for word in _MIXED_DTYPE_WORDS):
        return
    listed = ", ".join(f"'{n}'" for n in kept[:3]) + (" ..." if len(kept) > 3 else "")
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    error.add_note(f"zero: the model's floating buffers keep their dtype ({len(kept)}: "
                   f"{listed}), as DeepSpeed 0.19 keeps them; a forward that mixes one into "
                   f"{dtype} activations gets float32 out. buffer_dtype=\"{name}\" (a DeepSpeed "
                   f"config: \"data_types\": {{\"buffer_dtype\": \"{name}\"}}) casts them "
                   "with the parameters (docs/engine.md, \"Buffers keep their dtype\")")


def _buffer_dtype(t, dtype, buffer_dtype, is_statistic):
    """The dtype cast_module gives buffer t (None: its own)."""
    if not t.is_floating_point():
        return None
    if is_statistic:
        return dtype
    return buffer_dtype


def warn_if_narrowed(dtypes: dict, compute_dtype):
    """float64 parameters train in the engine's fp32 masters, and 16-bit
    ones of another dtype than the compute dtype are cast to it: say so
    once (close() gives them back in their dtypes: [Note: dtypes given
    back] in _handback.py). dtypes: record_dtypes' answer."""
    wide = [name for (kind, name), dtype in dtypes.items()
            if kind == "parameter" and dtype == torch.float64]
    if wide:
        warn_user(f"zero: {len(wide)} float64 parameter(s) ({wide[0]!r} the first) train in "
                  f"float32 master weights and compute in {compute_dtype}: the engine keeps no "
                  "float64 copy. close() gives them back as float64", RuntimeWarning)
    # 16-bit parameters computed in another dtype: a bf16 part of an fp32
    # model doubles its bytes as fp32; fp16 in bf16 keeps fewer digits
    others = {}
    for (kind, name), dtype in dtypes.items():
        if kind == "parameter" and dtype.is_floating_point and dtype.itemsize == 2 and \
                dtype != compute_dtype:
            others.setdefault(dtype, []).append(name)
    for dtype, names in others.items():
        wanted = "bf16" if dtype == torch.bfloat16 else "fp16"
        warn_user(f"zero: {len(names)} {dtype} parameter(s) ({names[0]!r} the first) are "
                  f"cast to {compute_dtype}, the engine's compute dtype (precision), which "
                  "trains the whole model in one dtype; to compute in their dtype pass "
                  f"precision=\"{wanted}\" (a DeepSpeed config: \"{wanted}\": {{\"enabled\": "
                  f"true}}). close() gives them back as {dtype}", RuntimeWarning)
