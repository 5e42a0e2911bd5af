"""What the tensor- and pipeline-parallel tests share: a tiny GPT
(examples/gpt.py), a tiny HuggingFace Llama and GPT-2, the optimizers, the data,
the single-process torch reference every layout is compared with, and the
meshes."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples"))
from gpt import GPT, GPTConfig  # noqa: E402
from conftest import max_rel_error  # noqa: E402

CFG = GPTConfig(vocab=64, dim=32, layers=4, heads=4, seq=8)
STEPS = 4
BATCH = 8
TOL = 1e-5
# SGD with momentum: its update is linear in the gradient, so a few ulps of
# difference in the gradients stay a few ulps in the parameters. Adam
# divides each element by its own gradient's size, which multiplies the
# relative error of an element whose gradient nearly cancels by as much as
# the cancellation: measured on this model up to 3.3e-5 (normwise) on an
# AMD EPYC, and 1.2e-4 and 2.6e-4 on an Intel Xeon with AMX (2026-12-06),
# where the one-process reference alone moves blocks.1.ln2.bias by 3.5e-5
# between 1 and 2 threads. So Adam's parameters are held to a tenth of one
# step (ADAM_LR) in absolute terms, what a wrong gradient direction would
# move an element by at least (a gradient of the wrong scale Adam hides
# anyway: SGD's checks catch it), and its losses to ADAM_TOL.
ADAM_LR = 2e-3
ADAM_TOL = 1e-4


def parameter_error_ok(ours, ref, opt, tol) -> bool:
    """ours within the tolerance of ref: normwise `tol` after SGD, a
    tenth of Adam's step after AdamW (see above)."""
    if opt == "adamw":
        return float((ours.detach().double() - ref.detach().double()).abs().max()) < ADAM_LR / 10
    return max_rel_error(ours, ref) < tol


def make_optimizer(name, model):
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=ADAM_LR)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def make_model(kind="gpt"):
    torch.manual_seed(0)
    if kind.startswith("llama"):  # "llama", "llama tied", "llama tied, 4 layers"
        return _llama(tied=kind.startswith("llama tied"),
                      layers=4 if kind.endswith("4 layers") else 2)
    if kind == "gpt2":
        return _gpt2()
    model = GPT(CFG)
    for block in model.blocks:
        block.k.bias.requires_grad_(False)
        # attention that is not uniform at the start: with GPT's 0.02 the
        # scores are ~1e-3, the queries' gradients nearly cancel, and
        # Adam's normalized steps on them are rounding noise again
        for linear in (block.q, block.k):
            torch.nn.init.normal_(linear.weight, std=0.3)
    return model


def _llama(tied=False, layers=2):
    """A tiny HuggingFace Llama (grouped-query attention: 4 heads, 2 key/
    value heads); tied: its head tied to the embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=CFG.vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=CFG.seq, attn_implementation="eager",
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def _gpt2():
    """A tiny HuggingFace GPT-2 (Conv1D layers, q, k and v packed in one
    c_attn, its head tied to the embedding), without dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=CFG.vocab, n_embd=32, n_layer=2, n_head=4,
                        n_positions=CFG.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        attn_implementation="eager")
    return GPT2LMHeadModel(config)


def loss_of(model, ids, labels):
    """GPT takes the next tokens as labels; a HuggingFace model shifts them
    itself."""
    if isinstance(model, GPT) or isinstance(getattr(model, "module", None), GPT):
        return model(ids, labels)
    return model(input_ids=ids, labels=ids).loss


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CFG.vocab, (BATCH, CFG.seq), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def reference(accumulation=1, clip=None, opt="sgd", kind="gpt"):
    """One process of plain torch on the whole batch: (losses, norms, state)."""
    model = make_model(kind)
    opt = make_optimizer(opt, model)
    losses, norms = [], []
    for step in range(STEPS):
        ids, labels = batch(step)
        total = 0.0
        for ids_m, labels_m in zip(ids.chunk(accumulation), labels.chunk(accumulation)):
            loss = loss_of(model, ids_m, labels_m)
            (loss / accumulation).backward()
            total += loss.item() / accumulation
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def watch_layouts(model, names) -> dict:
    """Forward hooks on the named modules (those the model has) that record
    their output's layout: (placements, local shape) of a DTensor, ("plain",
    shape) of a tensor. Sequence and vocabulary splits are checked on it."""
    seen = {}
    modules = dict(model.named_modules())

    def hook(module, args, output, name):
        out = output[0] if isinstance(output, tuple) else output
        if hasattr(out, "placements"):
            seen[name] = (tuple(str(p) for p in out.placements), tuple(out.to_local().shape))
        else:
            seen[name] = ("plain", tuple(out.shape))
    for name in names:
        if name in modules:
            modules[name].register_forward_hook(
                lambda m, a, o, name=name: hook(m, a, o, name))
    return seen


def mesh_of(shape, names):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def dp_place(mesh):
    """(this rank's data-parallel index, the data-parallel size) on `mesh`."""
    index, size = 0, 1
    for name in ("dp_replicate", "dp_shard"):
        if name in (mesh.mesh_dim_names or ()):
            index = index * mesh[name].size() + mesh[name].get_local_rank()
            size *= mesh[name].size()
    return index, size


