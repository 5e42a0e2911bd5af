"""The engine's gradient buckets at stages 2-3 in one process: a retired
bucket filled again within a backward ([Note: a spare bucket] in
sharding/_buckets.py), and buckets the C core cannot write itself (a GPU's)
written through the reducer ([Note: no zero-fill] in csrc/buckets.c), each
against torch. The core alone is in test_grad_buckets.py and
tests/c/test_bucket_gaps.c."""
import pytest
import torch
from torch import nn

import zero
from conftest import max_rel_error


@pytest.mark.parametrize("stage", [2, 3])
def test_a_retired_bucket_is_filled_again_within_a_backward(stage):
    """[Note: a spare bucket]: on the CPU the next bucket of the same size
    reuses the last one retired (so fewer allocations than buckets), with
    the last bucket's values still in it ([Note: no zero-fill] in
    csrc/buckets.c: the core overwrites it): the gradients are torch's,
    step after step."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    ref = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    ref.load_state_dict(net.state_dict())
    engine = zero.initialize(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                             stage=stage, stage3_param_persistence_threshold=0,
                             reduce_bucket_size=32 * 32 + 32)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    reducer = engine.groups[0].reducer
    made, reused = [], []
    bucket_buffer = reducer._bucket_buffer

    def counted(n):
        spare = reducer.spare
        buffer = bucket_buffer(n)
        (reused if buffer is spare else made).append(n)
        return buffer
    reducer._bucket_buffer = counted
    buckets = len(reducer.buckets)
    for step in range(3):
        made.clear()
        reused.clear()
        x = torch.randn(4, 32)
        engine.backward(engine(x).square().sum())
        assert len(made) + len(reused) == buckets, (step, made, reused)
        engine.step()
        ref_opt.zero_grad()
        ref(x).square().sum().backward()
        ref_opt.step()
        assert buckets >= 6 and len(made) < buckets, (step, len(made), buckets)
    state = engine.full_state_dict()
    for name, p in ref.state_dict().items():
        assert max_rel_error(state[name], p) < 1e-6, name
    engine.close()


class _OddSizes(nn.Module):
    """Widths that are no multiple of 64 (gaps between the parameters in
    their unit) and a layer that never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(30, 7)
        self.b = nn.Linear(7, 5)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("stage", [2, 3])
def test_buckets_the_core_cannot_write_take_the_owners_path(stage):
    """A GPU's buckets are written through the reducer ([Note: no
    zero-fill] in csrc/buckets.c: _add_piece copies a first piece and adds
    a later one, _zero_range zeroes what no piece wrote). The same path on
    the CPU: buckets made strided (so the core cannot write them) and full
    of NaN (as an unzeroed GPU block may be); the training is torch's."""
    torch.manual_seed(0)
    net, ref = _OddSizes(), _OddSizes()
    ref.load_state_dict(net.state_dict())
    engine = zero.initialize(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                             stage=stage, stage3_param_persistence_threshold=0,
                             reduce_bucket_size=200)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    reducer = engine.groups[0].reducer
    zeroed = []

    def strided_garbage(n):
        return torch.full((2 * n,), float("nan"), dtype=reducer.fg.compute_dtype)[::2]
    zero_range = reducer._zero_range

    def counted_zero_range(bucket, start, count):
        zeroed.append(count)
        zero_range(bucket, start, count)
    reducer._bucket_buffer = strided_garbage
    reducer._zero_range = counted_zero_range
    for _ in range(3):
        x = torch.randn(4, 30)
        for _micro in range(2):  # accumulation: two backwards a step
            engine.backward(engine(x).square().sum())
        engine.step()
        ref_opt.zero_grad()
        for _micro in range(2):
            ref(x).square().sum().backward()
        ref_opt.step()
    assert zeroed  # the gaps and the unused layer went through the owner
    state = engine.full_state_dict()
    for name, p in ref.state_dict().items():
        assert max_rel_error(state[name], p) < 1e-6, name
    engine.close()
