"""Ready tensor-parallel plans (Megatron-LM's layouts, in torch's DTensor
parallel styles) for examples/gpt.py's GPT, HuggingFace GPT-2 and
HuggingFace Llama-family decoders, applied with torch's
parallelize_module. GPT-2's Conv1D layers take zero's own styles
(parallel/_conv1d_styles.py, [Note: Conv1D styles]).

Each transformer block splits its attention by heads (q, k, v column-wise,
the output projection row-wise) and its MLP by the hidden size (up/gate
column-wise, down row-wise): one all-reduce in forward and one in backward
per half-block, as in Megatron-LM. The embedding is vocabulary-parallel
(rows split; the partial lookups all-reduced) and so is the output head
(its logits gathered whole, so any loss works on them; or, with
loss_parallel=True, left split by vocabulary as a DTensor for torch's
loss_parallel() cross entropy, which never gathers them). LayerNorms and the
position embedding stay whole on every tp rank. A tied head keeps its tie:
parallelize_module gives each module a DTensor of its own, so the plan
ties them again (both are split by vocabulary rows, Shard(0)).

[Note: sequence parallelism] sequence_parallel=True adds Megatron-LM's
sequence parallelism (Korthikanti et al. 2022) to the GPT, Llama and GPT-2
plans:
between the tensor-parallel regions the residual stream, the norms and
their activations are split by sequence over tp instead of repeated on
every tp rank, so those activations take 1/tp of the memory. The
embedding's partial lookups are reduce-scattered by sequence (not
all-reduced), each norm runs on its sequence shard (SequenceParallel: its
weights replicated DTensors), the norm's output is all-gathered once for
the projections that share it, and each row-parallel output is
reduce-scattered back to sequence shards: a reduce-scatter plus an
all-gather where the plain plan has one all-reduce, the same bytes. The
residual stream is a DTensor (Shard(1), its global shape), so the model's
own code (x.shape, its position ids and masks) sees the whole sequence;
a pipeline stage sends and receives its local shard. The sequence length
must divide by tp.
"""
from __future__ import annotations

import fnmatch

from torch import nn

from zero.parallel._plan_arguments import check_flags, check_line, check_model


def _styles():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return Replicate, ColwiseParallel, RowwiseParallel


def _head_style(loss_parallel: bool, sequence_parallel: bool = False):
    """The output head, column-wise over the vocabulary: its logits
    gathered whole (Replicate), or kept split (Shard(-1), a DTensor) for a
    cross entropy computed under torch's loss_parallel() context. Under
    sequence parallelism its input (the final norm's) is gathered first."""
    from torch.distributed.tensor import Shard
    Replicate, Colwise, _ = _styles()
    inputs = {"input_layouts": Shard(1)} if sequence_parallel else {}
    if loss_parallel:
        return Colwise(output_layouts=Shard(-1), use_local_output=False, **inputs)
    return Colwise(output_layouts=Replicate(), **inputs)


def _shared_replicated(sequence_parallel: bool):
    """A norm whose output the next projections share, as one replicated
    DTensor (its gradient summed over tp once). Under sequence parallelism
    the norm first runs on its sequence shard, and its output is gathered
    (a tuple: the styles applied in order, [Note: sequence parallelism])."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel
    Replicate = _styles()[0]
    if not sequence_parallel:
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(),
                                   use_local_output=False)
    return (SequenceParallel(),
            PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                use_local_output=False))


def _embedding_style(sequence_parallel: bool):
    """The vocabulary-parallel embedding: its partial lookups all-reduced,
    or reduce-scattered into sequence shards (a DTensor of the whole
    shape, the residual stream of [Note: sequence parallelism])."""
    from torch.distributed.tensor import Shard
    Replicate, _, Rowwise = _styles()
    if sequence_parallel:
        return Rowwise(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    return Rowwise(input_layouts=Replicate(), output_layouts=Replicate())


def _row_style(sequence_parallel: bool, style=None):
    """A row-parallel output projection (torch's RowwiseParallel, or
    `style`, its Conv1D twin): its partial sums all-reduced, or
    reduce-scattered into the residual stream's sequence shards."""
    from torch.distributed.tensor import Shard
    style = style or _styles()[2]
    if sequence_parallel:
        return style(output_layouts=Shard(1), use_local_output=False)
    return style()


def _positions_by_sequence(dim: int):
    """A position embedding's output (whole on every tp rank) split by
    sequence along `dim`, to add to the embedding's sequence shards."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleOutput
    return PrepareModuleOutput(output_layouts=_styles()[0](), desired_output_layouts=Shard(dim),
                               use_local_output=False)


def gpt_plan(loss_parallel: bool = False, sequence_parallel: bool = False) -> dict:
    """The plan for examples/gpt.py's GPT (module names to parallel styles,
    or tuples of styles applied in order). The first LayerNorm's output
    becomes one replicated DTensor that q, k and v share: its gradient is
    then summed over tp once, as Megatron's f operator does, instead of
    once per projection (measured by bench/parallel.py: two all-reduces a
    layer fewer). sequence_parallel: [Note: sequence parallelism]; the
    position embedding's output is then split by sequence too, to add to
    the embedding's."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import SequenceParallel
    _, Colwise, _ = _styles()
    plan = {"embed": _embedding_style(sequence_parallel),
            "head": _head_style(loss_parallel, sequence_parallel),
            "blocks.*.ln1": _shared_replicated(sequence_parallel)}
    if sequence_parallel:
        plan["pos"] = _positions_by_sequence(0)  # pos(arange(t)) is (t, dim)
        plan["blocks.*.ln2"] = SequenceParallel()
        plan["ln"] = SequenceParallel()
        # the MLP's input gathered once from the sequence shards
        plan["blocks.*.up"] = Colwise(input_layouts=Shard(1))
    else:
        plan["blocks.*.up"] = Colwise()
    for name in ("q", "k", "v"):
        plan[f"blocks.*.{name}"] = Colwise()
    for name in ("proj", "down"):
        plan[f"blocks.*.{name}"] = _row_style(sequence_parallel)
    return plan


def llama_plan(model: nn.Module, loss_parallel: bool = False,
               sequence_parallel: bool = False) -> dict:
    """The plan for a HuggingFace LlamaForCausalLM (and decoders laid out as
    it is: Mistral, Qwen2): model.embed_tokens, model.layers.*.self_attn
    .{q,k,v,o}_proj, model.layers.*.mlp.{gate,up,down}_proj, lm_head.
    sequence_parallel: [Note: sequence parallelism]."""
    from torch.distributed.tensor.parallel import SequenceParallel
    _, Colwise, _ = _styles()
    base = _base_name(model)
    plan = {f"{base}embed_tokens": _embedding_style(sequence_parallel)}
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = _head_style(loss_parallel, sequence_parallel)
    if sequence_parallel:
        plan[f"{base}norm"] = SequenceParallel()
    layers = f"{base}layers.*."
    # each norm's output one replicated DTensor that its projections share
    # (q, k, v; gate, up): one all-reduce of its gradient, as in gpt_plan
    for name in ("input_layernorm", "post_attention_layernorm"):
        plan[layers + name] = _shared_replicated(sequence_parallel)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "mlp.gate_proj", "mlp.up_proj"):
        plan[layers + name] = Colwise()
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        plan[layers + name] = _row_style(sequence_parallel)
    return plan


def _base_name(model) -> str:
    return "model." if hasattr(model, "model") and hasattr(model.model, "layers") else ""


def _check_divides(what, size, tp):
    if size % tp:
        raise ValueError(f"{what} ({size}) is not divisible by the tp size ({tp}); tensor "
                         "parallelism splits it evenly over the tp ranks")


def _apply(model, tp_mesh, plan, ties, call):
    """parallelize_module with the plan's entries that name modules the
    model has (a pipeline stage holds some of them), a tuple of styles
    applied in order, then each (owner, name) in `ties` tied again to the
    first's parameter."""
    from torch.distributed.tensor.parallel import parallelize_module
    names = [name for name, _ in model.named_modules()]
    found = {key for key in plan if any(fnmatch.fnmatchcase(name, key) for name in names)}
    _check_layers_planned(model, plan, found, call)
    plan = {key: style if isinstance(style, tuple) else (style,)
            for key, style in plan.items() if key in found}
    tied = [(a, an, b, bn) for a, an, b, bn in ties
            if getattr(a, an, None) is not None and getattr(a, an) is getattr(b, bn, None)]
    for k in range(max((len(styles) for styles in plan.values()), default=0)):
        parallelize_module(model, tp_mesh, {key: styles[k] for key, styles in plan.items()
                                            if k < len(styles)})
    for a, an, b, bn in tied:
        setattr(b, bn, getattr(a, an))
    return model


def _check_layers_planned(model, plan, found, call):
    """Every layer entry of the plan (the ones with a '*': each block's
    modules) names modules of the model: a stage may lack the embedding or
    the head, never a block's parts. A model laid out otherwise (GPT-2 under
    the Llama plan, a fused qkv_proj) was split in part without a word: the
    head alone, its tie to the embedding broken (4.6% off torch after 3
    steps), or o_proj alone, which torch then failed on mid-forward."""
    layers = [key for key in plan if "*" in key]
    missing = [key for key in layers if key not in found]
    if missing:
        raise ValueError(f"{call}: {type(model).__name__} has no modules named "
                         f"{', '.join(repr(k) for k in missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''} (the plan's layers); it is "
                         "not laid out as this plan expects. Write a plan of its own for "
                         "torch's parallelize_module (docs/parallel.md)")


def _mark(model, tp_mesh, loss_parallel, sequence_parallel):
    """Record on the model what a pipeline stage of it needs to know
    ([Note: pipeline stages]): whether its residual stream is split by
    sequence over tp_mesh (a stage then turns the local shard it receives
    into the DTensor its blocks take), and whether its logits stay split
    by vocabulary (pipeline_schedule then runs the loss under torch's
    loss_parallel())."""
    # a rank's several stages (split with stages_per_rank > 1) each read it
    for target in (model, *getattr(model, "stages", ())):
        if sequence_parallel:
            target._zero_sequence_parallel = tp_mesh
        if loss_parallel:
            target._zero_loss_parallel = True


def parallelize_gpt(model: nn.Module, tp_mesh, loss_parallel: bool = False,
                    sequence_parallel: bool = False) -> nn.Module:
    """Split examples/gpt.py's GPT, or a pipeline stage of it (split_gpt),
    over `tp_mesh` (mesh["tp"]) in place and return it; heads, the MLP
    width and the vocabulary must divide by tp. loss_parallel=True leaves
    the head's logits split by vocabulary (a DTensor): compute the loss and
    call backward inside torch.distributed.tensor.parallel.loss_parallel()
    (docs/parallel.md). sequence_parallel=True splits the residual stream
    and the norms by sequence between the tensor-parallel regions ([Note:
    sequence parallelism]); under pipeline parallelism the sequence length must then
    divide by tp."""
    check_line(tp_mesh, "tp_mesh", "tp")
    check_model(model, ("cfg",), "examples/gpt.py's GPT (or a stage of it)", "parallelize_gpt")
    check_flags(loss_parallel=loss_parallel, sequence_parallel=sequence_parallel)
    tp = tp_mesh.size()
    cfg = model.cfg
    _check_divides("heads", cfg.heads, tp)
    _check_divides("the vocabulary", cfg.vocab, tp)
    ties = [(model.embed, "weight", model.head, "weight")] \
        if hasattr(model, "embed") and hasattr(model, "head") else []
    _mark(model, tp_mesh, loss_parallel, sequence_parallel)
    return _apply(model, tp_mesh, gpt_plan(loss_parallel, sequence_parallel), ties,
                  "parallelize_gpt")


def parallelize_llama(model: nn.Module, tp_mesh, loss_parallel: bool = False,
                      sequence_parallel: bool = False) -> nn.Module:
    """Split a HuggingFace Llama-family causal LM, or a pipeline stage of
    it (split_llama), over `tp_mesh` in place and return it; the attention
    and key/value heads, the intermediate size and the vocabulary must
    divide by tp. loss_parallel=True leaves the head's logits split by
    vocabulary (a DTensor): compute the loss and call backward inside
    torch.distributed.tensor.parallel.loss_parallel() (docs/parallel.md).
    sequence_parallel=True splits the residual stream and the norms by
    sequence between the tensor-parallel regions ([Note: sequence
    parallelism]); under pipeline parallelism the sequence length must then
    divide by tp."""
    check_line(tp_mesh, "tp_mesh", "tp")
    check_model(model, ("config",), "a HuggingFace Llama causal LM (or a stage of it)",
                "parallelize_llama")
    check_flags(loss_parallel=loss_parallel, sequence_parallel=sequence_parallel)
    tp = tp_mesh.size()
    cfg = model.config
    _check_divides("num_attention_heads", cfg.num_attention_heads, tp)
    _check_divides("num_key_value_heads",
                   getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, tp)
    _check_divides("vocab_size", cfg.vocab_size, tp)
    base = model.model if _base_name(model) else model
    ties = []
    if getattr(model, "lm_head", None) is not None and hasattr(base, "embed_tokens"):
        ties.append((base.embed_tokens, "weight", model.lm_head, "weight"))
    _mark(model, tp_mesh, loss_parallel, sequence_parallel)
    return _apply(model, tp_mesh, llama_plan(model, loss_parallel, sequence_parallel), ties,
                  "parallelize_llama")


def gpt2_plan(model: nn.Module, loss_parallel: bool = False,
              sequence_parallel: bool = False) -> dict:
    """The plan for a HuggingFace GPT2LMHeadModel (or GPT2Model):
    transformer.wte vocabulary-parallel, h.*.attn.c_attn column-wise with
    q, k and v each split by heads, h.*.attn.c_proj row-wise, h.*.mlp.c_fc
    column-wise, h.*.mlp.c_proj row-wise, lm_head column-wise (logits
    gathered). wpe and the LayerNorms stay whole. sequence_parallel: [Note:
    sequence parallelism]; wpe's output is then split by sequence too, to
    add to wte's, and each block's norms run on their sequence shards."""
    from torch.distributed.tensor.parallel import SequenceParallel
    from zero.parallel._conv1d_styles import conv1d_styles
    ColwiseConv1D, RowwiseConv1D = conv1d_styles()
    base = "transformer." if hasattr(model, "transformer") else ""
    plan = {f"{base}wte": _embedding_style(sequence_parallel),
            f"{base}h.*.attn.c_attn": ColwiseConv1D(packed=3),
            f"{base}h.*.attn.c_proj": _row_style(sequence_parallel, RowwiseConv1D),
            f"{base}h.*.mlp.c_fc": ColwiseConv1D(),
            f"{base}h.*.mlp.c_proj": _row_style(sequence_parallel, RowwiseConv1D)}
    if sequence_parallel:
        # wpe(position_ids) is (batch or 1, t, width)
        plan[f"{base}wpe"] = _positions_by_sequence(1)
        for name in ("ln_1", "ln_2"):
            plan[f"{base}h.*.{name}"] = _shared_replicated(True)
        plan[f"{base}ln_f"] = SequenceParallel()
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = _head_style(loss_parallel, sequence_parallel)
    return plan


def parallelize_gpt2(model: nn.Module, tp_mesh, loss_parallel: bool = False,
                     sequence_parallel: bool = False) -> nn.Module:
    """Split a HuggingFace GPT-2 over `tp_mesh` in place and return it. The
    heads, the MLP width and the vocabulary must divide by tp; each
    attention module then splits its c_attn output at its own heads' width
    (split_size: the embedding width / tp). Cross-attention (add_cross_
    attention) is refused. loss_parallel=True leaves the head's logits
    split by vocabulary (a DTensor): compute the loss and call backward
    inside torch.distributed.tensor.parallel.loss_parallel()
    (docs/parallel.md). sequence_parallel=True: as in parallelize_gpt."""
    check_line(tp_mesh, "tp_mesh", "tp")
    check_model(model, ("config", "config.n_head", "config.n_embd"), "a HuggingFace GPT-2 LM",
                "parallelize_gpt2")
    check_flags(loss_parallel=loss_parallel, sequence_parallel=sequence_parallel)
    tp = tp_mesh.size()
    cfg = model.config
    if getattr(cfg, "add_cross_attention", False):
        raise NotImplementedError("parallelize_gpt2: cross-attention (add_cross_attention) "
                                  "has no plan")
    _check_divides("n_head", cfg.n_head, tp)
    _check_divides("the MLP width", cfg.n_inner or 4 * cfg.n_embd, tp)
    _check_divides("vocab_size", cfg.vocab_size, tp)
    base = model.transformer if hasattr(model, "transformer") else model
    ties = []
    if getattr(model, "lm_head", None) is not None:
        ties.append((base.wte, "weight", model.lm_head, "weight"))
    _mark(model, tp_mesh, loss_parallel, sequence_parallel)
    _apply(model, tp_mesh, gpt2_plan(model, loss_parallel, sequence_parallel), ties,
           "parallelize_gpt2")
    for block in base.h:
        # c_attn's output is this rank's [q | k | v] heads: split at their width
        block.attn.split_size = cfg.n_embd // tp
    return model
