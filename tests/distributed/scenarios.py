"""The model, data and training loops shared by the distributed tests and
their single-process references."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB, DIM, BATCH, SEQ = 37, 13, 12, 5
PENALTY = 0.05  # penalty_of: large enough to move branch.weight on odd steps


class Net(nn.Module):
    """Every case the engine must get right: tied weights (embedding and
    head), a module called twice, a frozen layer, a branch used on even steps
    only, a buffer, sizes no world size divides; optionally the block under
    activation checkpointing ("reentrant" or "non_reentrant"), or the block
    and the head under reentrant checkpointing ("reentrant_all": the first
    gradients of a backward then arrive in a nested backward)."""

    def __init__(self, checkpointing=None):
        super().__init__()
        self.checkpointing = checkpointing
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.branch = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.head.weight = self.embed.weight
        self.register_buffer("mix", torch.tensor(0.5))

    def forward(self, ids, use_branch: bool):
        h = self.embed(ids).mean(1)
        h = torch.tanh(self._block(h))
        h = torch.tanh(self._block(h))
        h = h + self.frozen(h) * self.mix
        if use_branch:
            h = h + self.branch(h)
        if self.checkpointing == "reentrant_all":  # the first gradients, nested
            return checkpoint(self.head, h, use_reentrant=True)
        return self.head(h)

    def _block(self, h):
        if self.checkpointing is None:
            return self.block(h)
        return checkpoint(self.block, h, use_reentrant=self.checkpointing != "non_reentrant")


@contextlib.contextmanager
def torch_step():
    """Engines made inside take the torch-op step a GPU falls back to."""
    import zero.engine._engine
    from zero.step._step_path import TorchStep
    chosen = zero.engine._engine.step_path_for
    zero.engine._engine.step_path_for = TorchStep
    try:
        yield
    finally:
        zero.engine._engine.step_path_for = chosen


def make_model(seed=0, checkpointing=None):
    torch.manual_seed(seed)
    return Net(checkpointing)


def eval_batch(step):
    g = torch.Generator().manual_seed(77 + step)
    return torch.randint(0, VOCAB, (3, SEQ), generator=g)


def param_groups(model, lr=1e-2):
    first = [model.embed.weight, model.block.weight, model.block.bias]
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return [{"params": first, "weight_decay": 0.01},
            {"params": rest, "lr": lr / 2, "weight_decay": 0.0}]


def batch(step, seed=1):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH,), generator=g)
    return ids, labels


def shard(t, rank, world):
    per = t.shape[0] // world
    return t[rank * per:(rank + 1) * per]


def make_optimizer(name, model, lr):
    if name == "sgd":  # scale-sensitive, unlike Adam: catches a wrong 1/N
        return torch.optim.SGD(param_groups(model, lr), lr=lr, momentum=0.9)
    return torch.optim.AdamW(param_groups(model, lr), lr=lr)


def penalty_of(model):
    """A loss term on parameters outside forward: branch.weight's, which
    only the even steps' forwards use."""
    return PENALTY * model.branch.weight.pow(2).sum()


def reference_run(steps, accumulation=1, clip=0.0, lr=1e-2, seed=0, opt="adamw",
                  with_eval=False, modify_at=None, penalty=None):
    """Single process, full batch, torch.optim.AdamW. zero_grad keeps zeros
    (set_to_none=False): a parameter unused on a step then takes part with a
    zero gradient, as it does under the engine (and under DeepSpeed).
    with_eval: a no_grad forward on another batch before each step, its
    output sum appended to the losses. modify_at: before that step, halve
    row 0 of the embedding (the engine does it in GatheredParameters).
    penalty: penalty_of(model) added to each micro-batch's loss (the engine
    takes it inside GatheredParameters: "in loss" adds it to the loss,
    "apart" backwards it on its own)."""
    model = make_model(seed)
    opt = make_optimizer(opt, model, lr)
    losses = []
    for step in range(steps):
        if with_eval:
            with torch.no_grad():
                losses.append(model(eval_batch(step), use_branch=True).sum().item())
        if step == modify_at:
            with torch.no_grad():
                model.embed.weight[0].mul_(0.5)
        ids, labels = batch(step)
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for ids_m, labels_m in zip(ids.chunk(accumulation), labels.chunk(accumulation)):
            loss = F.cross_entropy(model(ids_m, use_branch=step % 2 == 0), labels_m)
            term = penalty_of(model) if penalty else 0.0
            ((loss + term) / accumulation).backward()
            total += loss.item() / accumulation
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_run(rank, world, steps, stage, precision="fp32", accumulation=1, clip=0.0,
               lr=1e-2, seed=0, opt="adamw", checkpointing=None, with_eval=False,
               modify_at=None, first_step=0, load_dir=None, save_dir=None, penalty=None,
               **options):
    """The same training under zero.initialize on this rank's shard of each
    batch; returns (global losses, full fp32 state dict, extra facts).
    A run in legs: steps first_step.. after engine.load_checkpoint(load_dir)
    (the state right after it in facts["loaded"]), then save_checkpoint(save_dir)."""
    import zero
    import torch.distributed as dist
    model = make_model(seed, checkpointing)
    engine = zero.initialize(model, optimizer=make_optimizer(opt, model, lr), stage=stage, precision=precision,
                             gradient_accumulation_steps=accumulation,
                             gradient_clipping=clip, **options)
    loaded = None
    if load_dir is not None:
        engine.load_checkpoint(load_dir)
        loaded = engine.full_state_dict()
    losses, skipped = [], []
    for step in range(first_step, first_step + steps):
        if with_eval:
            with torch.no_grad():
                out = engine(eval_batch(step).to(engine.device), use_branch=True)
                losses.append(out.float().sum().item())
        if step == modify_at:
            with zero.GatheredParameters([model.embed.weight], modifier_rank=0):
                with torch.no_grad():
                    # only rank 0's change may survive
                    model.embed.weight[0].mul_(0.5 if rank == 0 else 7.0)
        ids, labels = batch(step)
        ids, labels = shard(ids, rank, world), shard(labels, rank, world)
        ids, labels = ids.to(engine.device), labels.to(engine.device)
        total = 0.0
        for ids_m, labels_m in zip(ids.chunk(accumulation), labels.chunk(accumulation)):
            loss = F.cross_entropy(engine(ids_m, use_branch=step % 2 == 0).float(), labels_m)
            if penalty:
                with zero.GatheredParameters([model.branch.weight]):
                    term = penalty_of(model)  # saves branch.weight, released after
            if penalty == "in loss":
                engine.backward(loss + term)
            else:
                engine.backward(loss)
            if penalty == "apart":  # a backward that reaches no module output
                engine.backward(term)
            engine.step()
            total += loss.item() / accumulation
        t = torch.tensor([total])
        dist.all_reduce(t)
        losses.append(t.item() / world)
        skipped.append(engine.step_was_skipped)
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
    state = engine.full_state_dict()
    with zero.GatheredParameters(list(model.block.parameters())):
        gathered = {"block." + n: p.detach().float().cpu().clone()
                    for n, p in model.block.named_parameters()}
    facts = dict(memory=dict(engine.memory_summary()), comm=engine.comm_summary(),
                 skipped=skipped, gathered=gathered, loaded=loaded,
                 # backwards that gave up waiting for a bucket (a second each)
                 stalls=sum(fg.reducer.stalls for fg in engine.groups
                            if getattr(fg, "reducer", None) is not None))
    engine.close()
    return losses, state, facts


class Blocks(nn.Module):
    """Five repeated blocks between an embedding and a head: a unit per
    block at stage 3 ("block" units), and small units besides."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16))
            for _ in range(5))
        self.head = nn.Linear(16, 32)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


def make_blocks():
    torch.manual_seed(0)
    return Blocks()


def blocks_reference(world):
    """Blocks trained by one process's torch SGD (lr 0.1) on the whole
    world's batches: its state dict."""
    ref = make_blocks()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for every in blocks_batches(0, world)[1]:
        opt.zero_grad()
        ref(every).backward()
        opt.step()
    return ref.state_dict()


def blocks_batches(rank, world, steps=4):
    """This rank's batches for Blocks, and the whole world's (the reference's)."""
    g = torch.Generator().manual_seed(7)
    every = [torch.randint(0, 32, (2 * world, 8), generator=g) for _ in range(steps)]
    return [b[2 * rank:2 * rank + 2] for b in every], every


class GatedBlock(nn.Module):
    """A residual block whose gate is skipped when told: the module runs on
    every rank (stage 3 gathers alike), and a gate some ranks skip gets a
    rank-local gradient (its bucket leaves mid-backward on one rank and at
    the end on another)."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.gate = nn.Parameter(torch.randn(width, width) * 0.2)

    def forward(self, x, skip_gate):
        h = torch.tanh(self.linear(x))
        if not skip_gate:
            h = h @ self.gate
        return x + h


class GatedBlocks(nn.Module):
    """GatedBlocks(layers, width)(x, skipped): the blocks whose index is in
    `skipped` skip their gates; equal-sized parameters, so mismatched
    reductions would pair silently."""

    def __init__(self, layers, width):
        super().__init__()
        self.blocks = nn.ModuleList(GatedBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, width)

    def forward(self, x, skipped):
        for k, block in enumerate(self.blocks):
            x = block(x, k in skipped)
        return self.head(x)


def small_mlp():
    """The 6-8-3 MLP of the tests of ranks going different ways."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def small_mlp_batch(k, rank):
    """Batch k of `rank` for small_mlp."""
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * k + rank))


def small_mlp_reference(batches, world=2, before=None):
    """One process of torch SGD (lr 0.1) over the mean loss of every rank's
    small_mlp_batch for each k in `batches`; before(model, k), if given,
    runs first at each k. Returns the state dict."""
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for k in batches:
        if before is not None:
            before(model, k)
        opt.zero_grad()
        for rank in range(world):
            (model(small_mlp_batch(k, rank)).square().mean() / world).backward()
        opt.step()
    return model.state_dict()
