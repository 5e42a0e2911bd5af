"""zero.partitioned_init in one process: the model's own init code (module
constructors, trunc_normal_'s rejection sampling, orthogonal_, .data
writes, a padding row, a parameter scaled by another's sum, tied weights)
gives bit-identical parameters and leaves the random stream where a plain
construction leaves it; then zero.initialize trains it at stage 3."""
import pytest
import torch
from torch import nn

import zero


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 7, padding_idx=3)
        self.lin = nn.Linear(7, 9)
        self.orth = nn.Linear(9, 9, bias=False)
        self.raw = nn.Parameter(torch.randn(5))
        self.ln = nn.LayerNorm(9)
        self.head = nn.Linear(7, 11, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))
        nn.init.trunc_normal_(self.lin.weight, std=0.5, a=-0.4, b=0.4)
        nn.init.orthogonal_(self.orth.weight)
        self.lin.bias.data.normal_(mean=1.0, std=0.1)
        self.lin.weight.data[0].zero_()
        with torch.no_grad():
            self.raw.mul_(self.lin.weight.sum())

    def forward(self, ids):
        h = self.ln(self.orth(self.lin(self.emb(ids))))
        return self.head(h[..., :7] * self.raw[:1])


def build(partitioned, nvme_path=None):
    torch.manual_seed(5)
    if partitioned:
        with zero.partitioned_init(nvme_path=nvme_path):
            model = Odd()
    else:
        model = Odd()
    return model, torch.rand(3)


def assert_engine_holds(model, ref):
    """zero.initialize(model) at stage 3 holds exactly ref's values."""
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3)
    state = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value.float()), name
    engine.close()


def test_values_and_random_stream_match_plain_construction():
    ref, after_ref = build(False)
    model, after = build(True)
    assert torch.equal(after, after_ref)
    assert model.head.weight is model.emb.weight
    assert_engine_holds(model, ref)


def test_chunks_in_files_give_the_same_model(tmp_path):
    """nvme_path: every chunk lives in a mapped file there (unlinked: the
    directory stays empty), not resident once built, and the values, the
    random stream and the engine's partitions are the same."""
    from zero.sharding._partitioned_init import sharded_record
    ref, after_ref = build(False)
    model, after = build(True, nvme_path=tmp_path)
    assert torch.equal(after, after_ref)
    records = [sharded_record(p) for p in model.parameters()]
    assert all(r is not None and r._file is not None for r in records)
    assert all(r.chunk.data_ptr() == r._file.tensor.data_ptr() for r in records)
    assert list(tmp_path.iterdir()) == []
    assert_engine_holds(model, ref)


@pytest.mark.parametrize("path, error", [("/nonexistent-zero-dir", ValueError), (3, TypeError)])
def test_a_bad_nvme_path_is_refused_by_name(path, error):
    with pytest.raises(error, match="partitioned_init nvme_path"):
        zero.partitioned_init(nvme_path=path)


def test_trains_like_the_plain_model():
    ref, _ = build(False)
    model, _ = build(True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=0)
    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        ref_opt.zero_grad()
        ref(ids).square().mean().backward()
        ref_opt.step()
        engine.backward(engine(ids).square().mean())
        engine.step()
    state = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(state[name], value.float(), rtol=1e-6, atol=1e-7)
    engine.close()


def test_running_it_again_holds_the_group_once():
    """A notebook cell with partitioned_init run again: the group it keeps
    for the life of the process is held once (each run added a reference,
    so no close() could ever end it), and an engine's close() leaves just
    that one."""
    from zero.comm import _comm
    for _ in range(3):
        model, _ = build(True)
        engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 stage=3)
        assert _comm._owned["count"] == 2  # partitioned_init's and this engine's
        engine.close()
        assert _comm._owned["count"] == 1


def test_placeholder_outside_the_context_refuses_writes():
    model, _ = build(True)
    with pytest.raises(RuntimeError):
        with torch.no_grad():
            model.lin.weight.add_(1.0)


class Copies(nn.Module):
    """Init that writes one parameter from another, through .data and out=,
    and a dtype change inside the context."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.tensor(0.5))
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight)
            self.b.bias.data.add_(self.a.bias)
            torch.mul(self.a.weight, 2.0, out=self.c.weight)
        self.c.half()
        nn.init.normal_(self.c.bias)


def plain_and_partitioned(cls, seed):
    """(cls() built plainly, cls() built under partitioned_init), both from
    `seed`."""
    torch.manual_seed(seed)
    ref = cls()
    torch.manual_seed(seed)
    with zero.partitioned_init():
        model = cls()
    return ref, model


def test_init_that_reads_other_parameters_and_changes_dtype():
    assert_engine_holds(*reversed(plain_and_partitioned(Copies, 3)))


class Diagonals(nn.Module):
    """Init ops that write a diagonal: fill_diagonal_ (which torch
    decomposes through the tensor's strides before a dispatch mode sees
    it: on a placeholder it wrote the first element only), through .data
    and under no_grad, square and tall (wrap=True), and nn.init's eye_ and
    dirac_."""
    def __init__(self):
        super().__init__()
        self.square = nn.Linear(6, 6)
        self.tall = nn.Linear(3, 10)
        self.eye = nn.Linear(5, 4)
        self.conv = nn.Conv1d(4, 4, 3)
        self.square.weight.data.fill_diagonal_(3.0)
        with torch.no_grad():
            self.tall.weight.fill_diagonal_(-2.0, wrap=True)
            self.square.weight[1:].fill_diagonal_(7.0)  # a view's diagonal
        nn.init.eye_(self.eye.weight)
        nn.init.dirac_(self.conv.weight)


def test_diagonal_writes_match_plain_construction():
    ref, model = plain_and_partitioned(Diagonals, 4)
    assert_engine_holds(model, ref)


def test_a_diagonal_written_with_grad_on_is_refused_as_torch_refuses_it():
    with zero.partitioned_init():
        weight = nn.Linear(4, 4).weight
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            weight.fill_diagonal_(1.0)


def test_a_context_kept_by_the_caller_holds_no_chunk_after_initialize():
    """initialize frees each chunk as it takes it: a partitioned_init kept
    in a variable (or in a cycle) held every one of them till it went."""
    import gc
    from zero.sharding._partitioned_init import _Sharded
    torch.manual_seed(0)
    context = zero.partitioned_init()
    with context:
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3)
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is _Sharded]
    engine.close()
    del context


def test_write_to_a_one_element_placeholder_after_the_context_is_refused():
    torch.manual_seed(3)
    with zero.partitioned_init():
        model = Copies()
    with torch.no_grad():
        model.scale.fill_(2.0)  # a one-element placeholder accepts the write
    with pytest.raises(RuntimeError, match="written after the context closed"):
        zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), stage=3)


class FromLists(nn.Module):
    """Parameters and buffers computed from lists of parameters."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.qk = nn.Parameter(torch.cat([self.q.weight, self.k.weight]))
        self.stacked = nn.Parameter(torch.stack([self.q.bias, self.k.bias]))
        self.register_buffer("qv", nn.utils.parameters_to_vector(self.q.parameters()))
        self.register_buffer("w0", self.q.weight.detach().clone())

    def forward(self, x):
        return self.q(x) + self.k(x) + self.qk[:8].sum() + self.stacked.sum()


def test_ops_on_lists_of_parameters():
    torch.manual_seed(4)
    ref = FromLists()
    torch.manual_seed(4)
    with zero.partitioned_init():
        model = FromLists()
    assert ref.qk.abs().sum() > 0  # zeros would pass a careless comparison
    assert_engine_holds(model, ref)


class AliasBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("w0", self.lin.weight.detach())  # shares the weight's memory


def test_buffer_that_aliases_a_parameter_is_refused():
    with zero.partitioned_init():
        with pytest.raises(ValueError, match="buffer 'w0' of AliasBuffer is the memory of a "
                                             "parameter built in zero.partitioned_init"):
            AliasBuffer()


@pytest.mark.parametrize("cast", ["bfloat16", "half"])
def test_cast_after_the_context_keeps_the_values(cast):
    """model.to(torch.bfloat16) between the context and initialize reads
    the placeholders (zeros) outside the context: the chunks' values are
    cast instead, as the plain model's would be."""
    torch.manual_seed(5)
    ref = getattr(Odd(), cast)()
    model, _ = build(True)
    model = getattr(model, cast)()
    assert_engine_holds(model, ref)


@pytest.mark.parametrize("device", [torch.device("cpu", 0), "cpu:0"])
def test_a_move_after_the_context_keeps_the_values(device):
    """model.to("cpu:0") (the HF Trainer's move under torchrun; "cuda:0" on
    a GPU) copies the placeholders' zeros into full tensors: the engine
    trained a model of zeros, silently (an HF hunt). The copies are read
    as the placeholders they were."""
    torch.manual_seed(5)
    ref = Odd()
    model, _ = build(True)
    model.to(device)
    assert_engine_holds(model, ref)


def test_data_given_after_the_context_counts():
    """New values given after the context (not zeros) are the model's."""
    model, _ = build(True)
    with torch.no_grad():
        given = {name: torch.randn(p.shape) for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            p.data = given[name].clone()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3)
    full = engine.full_state_dict()
    assert all(torch.equal(full[name], value) for name, value in given.items())
    engine.close()


def test_in_place_op_over_a_list_of_parameters_is_refused():
    with zero.partitioned_init():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        with pytest.raises(RuntimeError, match="writes a list of tensors that holds parameters"):
            with torch.no_grad():
                torch._foreach_mul_(list(model.parameters()), 3.0)


class DataGiven(nn.Module):
    """Init code that gives parameters a placeholder's data inside the
    context: a ViT's `w.data = trunc_normal_(w.data.to(float32)).to(dtype)`,
    resize_token_embeddings' `old.weight.data = new.weight.data` (the new
    module dropped after), and a fused q/k/v weight and bias initialized in
    chunk and split views."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Linear(6, 8)
        w = self.patch.weight
        w.data = nn.init.trunc_normal_(w.data.to(torch.float32), std=0.02).to(w.dtype)
        self.embed = nn.Embedding(5, 8)
        bigger = nn.Embedding(7, 8)
        with torch.no_grad():
            bigger.weight[:5] = self.embed.weight
        self.embed.weight.data = bigger.weight.data
        self.embed.num_embeddings = 7
        self.qkv = nn.Linear(8, 24)
        for part in self.qkv.weight.chunk(3):
            nn.init.xavier_uniform_(part)
        with torch.no_grad():
            for part in self.qkv.bias.split(10):
                part.uniform_(-0.1, 0.1)

    def forward(self, ids):
        return self.qkv(self.embed(ids)).sum() + self.patch.weight.sum()


def test_data_given_inside_the_context_is_the_data_it_stands_for():
    """p.data = (a placeholder's data) read the placeholder's zeros after
    the context (a ViT's patch weights, resize_token_embeddings' rows),
    and chunk/unbind of a parameter raised; now bit-identical."""
    torch.manual_seed(3)
    ref = DataGiven()
    after_ref = torch.rand(3)
    torch.manual_seed(3)
    with zero.partitioned_init():
        model = DataGiven()
    assert torch.equal(torch.rand(3), after_ref)
    assert_engine_holds(model, ref)


def test_a_zero_written_after_the_context_is_refused():
    """A placeholder reads as zeros after the context, so writing a zero
    went unseen (and was lost); the write's version bump is seen."""
    with zero.partitioned_init():
        model = nn.Linear(4, 4)
    nn.init.zeros_(model.weight)  # (through .data, a counter of its own: unseen)
    with pytest.raises(RuntimeError, match="was written after the context closed"):
        zero.initialize(model, stage=3)


def test_a_lazy_module_is_refused_by_name():
    with pytest.raises(TypeError, match="LazyLinear.weight is a lazy parameter"):
        with zero.partitioned_init():
            nn.LazyLinear(4)
