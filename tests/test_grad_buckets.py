"""zero._C.GradBuckets, the C bucket plan and hook, through its Python face:
the pieces it adds land where a plain torch computation of the same plan
puts them, bit for bit, on the C path (dense CPU tensors of the bucket's
dtype) and on the owner's path (anything else); buckets leave in order,
each once; a dead or detached owner makes the hooks inert; bad arguments
are refused by name. The engine-level parity of stages 2-3 is in the
engine and distributed tests."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import zero._C as _C
from zero._C import GradBuckets


class Owner:
    """What the engine's BucketReducer does, recorded. Its buckets start as
    garbage (NaN), as the engine's are not zeroed ([Note: no zero-fill]):
    what no piece wrote must come back zero. With `strided_buckets` they
    are not contiguous, so the core writes and zeroes them through the
    owner."""

    def __init__(self, dtype, strided_buckets=False):
        self.dtype = dtype
        self.sent, self.units, self.began = [], [], 0
        self.slow = set()  # shapes of the gradients added by _add_piece
        self.zeroed = []  # ranges zeroed by _zero_range
        self.sizes = {}
        self.strided_buckets = strided_buckets

    def _new_bucket(self, b, late):
        if self.strided_buckets:
            return torch.full((2 * self.sizes[b],), float("nan"), dtype=self.dtype)[::2]
        return torch.full((self.sizes[b],), float("nan"), dtype=self.dtype)

    def _send_bucket(self, b, tensor):
        self.sent.append((b, tensor.clone()))

    def _unit_arrived(self, unit):
        self.units.append(unit)

    def _backward_began(self):
        self.began += 1

    def _add_piece(self, grad, bucket, bucket_start, grad_start, count, first):
        self.slow.add(tuple(grad.shape))
        piece = grad.reshape(-1)[grad_start:grad_start + count]
        target = bucket[bucket_start:bucket_start + count]
        target.copy_(piece) if first else target.add_(piece)

    def _zero_range(self, bucket, start, count):
        self.zeroed.append((start, count))
        bucket[start:start + count].zero_()


def make(dtype, units, offsets, numels, spans, bucket_elements, strided_buckets=False):
    owner = Owner(dtype, strided_buckets)
    core = GradBuckets(units, offsets, numels, spans, bucket_elements, owner=owner,
                       dtype=dtype, tensor_type=torch.Tensor, strided=torch.strided)
    for b in range(core.count):
        _u, start, end = core.bucket(b)
        owner.sizes[b] = end - start
    return owner, core


def reference_buckets(core, units, offsets, grads, spans):
    """Each unit's flat gradient laid out as the plan says, cut into the
    buckets: what the buckets must hold when every gradient came once."""
    flats = [torch.zeros(s, dtype=grads[0].dtype) for s in spans]
    for i, g in enumerate(grads):
        flats[units[i]][offsets[i]:offsets[i] + g.numel()].add_(g.reshape(-1))
    out = []
    for b in range(core.count):
        u, start, end = core.bucket(b)
        out.append(flats[u][start:end])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided buckets"])
def test_pieces_land_where_the_plan_says(dtype, layout):
    torch.manual_seed(0)
    shapes = [(3, 5), (7,), (4, 4), (2, 9), (6,)]
    units, offsets, spans, at, u = [], [], [], 0, 0
    for k, shape in enumerate(shapes):
        if k == 3:  # two units: the second starts at parameter 3
            spans.append(at + 2)  # with padding
            at, u = 0, 1
        units.append(u)
        offsets.append(at)
        at += torch.Size(shape).numel()
    spans.append(at)
    numels = [torch.Size(s).numel() for s in shapes]
    owner, core = make(dtype, units, offsets, numels, spans, bucket_elements=6,
                       strided_buckets=layout == "strided buckets")
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    grads = [torch.randn(s).to(dtype) for s in shapes]
    for i in reversed(range(len(params))):  # backward's order
        g = grads[i]
        if layout == "transposed" and g.dim() == 2:
            g = g.t().contiguous().t()  # same values, not contiguous
        params[i].grad = g
        core.hook(i)(params[i])
        assert params[i].grad is None
    assert owner.began == 1
    assert [b for b, _ in owner.sent] == list(range(core.count))
    want = reference_buckets(core, units, offsets, grads, spans)
    for (b, got), expect in zip(owner.sent, want):
        assert torch.equal(got, expect), b
    assert sorted(owner.units) == [0, 1]
    # the C path took the dense ones; the owner the strided ones, and every
    # piece into a bucket it cannot write itself
    assert len(owner.slow) == {"contiguous": 0, "transposed": 3,
                               "strided buckets": len(shapes)}[layout]
    # the padding at the first unit's end (its [38, 40): [4, 6) of bucket
    # [34, 40)), zeroed through the owner where the core cannot reach it
    assert owner.zeroed == ([] if layout != "strided buckets" else [(4, 2)])
    assert core.arrived() == b"\x01" * len(shapes)


def test_sums_round_like_torch():
    """Two parts of one gradient (reentrant checkpointing) add in the
    bucket with torch's rounding; the second part, after the bucket left,
    goes to the late buffer."""
    torch.manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        owner, core = make(dtype, [0], [0], [1000], [1000], bucket_elements=1000)
        p = torch.nn.Parameter(torch.zeros(1000, dtype=dtype))
        a, b = torch.randn(1000).to(dtype), torch.randn(1000).to(dtype)
        p.grad = a.clone()
        core.hook(0)(p)
        assert len(owner.sent) == 1 and torch.equal(owner.sent[0][1], a)
        p.grad = b.clone()
        core.hook(0)(p)
        assert core.late_buckets() == [0]
        late = core.take_late(0)
        assert torch.equal(late, b) and core.take_late(0) is None
    # and a sum of two parts before the bucket leaves, against add_: the
    # first part is copied in, the second added
    for dtype in (torch.bfloat16, torch.float16):
        for strided in (False, True):
            owner, core = make(dtype, [0, 0], [0, 500], [500, 500], [1000],
                               bucket_elements=1000, strided_buckets=strided)
            core.reset(b"\x01\x00")  # parameter 1 is not waited for
            ps = [torch.nn.Parameter(torch.zeros(500, dtype=dtype)) for _ in range(2)]
            g0, g1a, g1b = (torch.randn(500).to(dtype) for _ in range(3))
            ps[1].grad = g1a.clone()
            core.hook(1)(ps[1])
            ps[1].grad = g1b.clone()
            core.hook(1)(ps[1])
            assert owner.sent == []
            ps[0].grad = g0.clone()
            core.hook(0)(ps[0])
            assert torch.equal(owner.sent[0][1], torch.cat([g0, g1a.clone().add_(g1b)]))


def test_unwritten_ranges_come_back_zero():
    """Buckets start as garbage: what no gradient reached (padding, a
    parameter without a gradient, a bucket nobody wrote, a late buffer's
    other pieces) travels as zeros, on the core's path and the owner's."""
    torch.manual_seed(2)
    for strided in (False, True):
        # unit 0: p0 [1, 4), p1 [6, 9), span 12; buckets of 5 from the end:
        # b0 [7, 12), b1 [2, 7), b2 [0, 2)
        owner, core = make(torch.float32, [0, 0], [1, 6], [3, 3], [12],
                           bucket_elements=5, strided_buckets=strided)
        core.reset(b"\x00\x01")  # p0 is not waited for: every bucket leaves with p1
        ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
        g0, g1 = torch.randn(3), torch.randn(3)
        ps[1].grad = g1.clone()
        core.hook(1)(ps[1])
        assert [b for b, _ in owner.sent] == [0, 1, 2]
        flat = torch.zeros(12)
        flat[6:9] = g1
        for b, (start, end) in enumerate([(7, 12), (2, 7), (0, 2)]):
            assert torch.equal(owner.sent[b][1], flat[start:end])  # b2: no piece
        ps[0].grad = g0.clone()  # after its buckets left: both pieces late
        core.hook(0)(ps[0])
        late = torch.zeros(12)
        late[1:4] = g0
        assert core.late_buckets() == [1, 2]
        assert torch.equal(core.take_late(1), late[2:7])
        assert torch.equal(core.take_late(2), late[0:2])
        assert strided == bool(owner.zeroed)


def test_a_late_buffer_taken_again_from_the_owners_zeroing_is_handed_out_once():
    """take_late(b) zeroes the buffer's unwritten ranges through the owner's
    _zero_range (a strided buffer); an owner that took the same bucket from
    there left the outer call returning a tensor it did not own (C hunt: a
    use after free, then a segfault). The inner call gets the tensor and
    the outer one a reference of its own."""
    import sys
    owner, core = make(torch.float32, [0, 0], [0, 4], [4, 6], [10], bucket_elements=100,
                       strided_buckets=True)
    core.reset(b"\x01\x00")  # p0 alone is waited for
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    core.hook(0)(p)  # the bucket leaves
    p.grad = torch.ones(4)
    core.hook(0)(p)  # a second gradient: late
    taken, calls = [], []
    zero_range = owner._zero_range

    def take_from_inside(bucket, start, count):
        zero_range(bucket, start, count)
        calls.append((start, count))
        if len(calls) == 1:  # once, from the outer call
            taken.append(core.take_late(0))
    owner._zero_range = take_from_inside
    outer = core.take_late(0)
    assert outer is taken[0] and sys.getrefcount(outer) >= 3
    assert torch.equal(outer, torch.tensor([1.0] * 4 + [0.0] * 6))
    assert core.late_buckets() == [] and core.take_late(0) is None


def test_buckets_leave_in_order_once_complete():
    owner, core = make(torch.float32, [0, 0, 0], [0, 4, 8], [4, 4, 4], [12],
                       bucket_elements=4)
    ps = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    # bucket 0 is parameter 2's; parameter 0 first: nothing leaves
    ps[0].grad = torch.ones(4)
    core.hook(0)(ps[0])
    assert owner.sent == [] and core.started and core.sent == 0
    ps[2].grad = torch.ones(4)
    core.hook(2)(ps[2])
    assert [b for b, _ in owner.sent] == [0]
    ps[1].grad = torch.ones(4)
    core.hook(1)(ps[1])
    assert [b for b, _ in owner.sent] == [0, 1, 2]
    core.reset(None)
    assert not core.started and core.arrived() == b"\x00\x00\x00"
    core.send_rest()  # nothing arrived: zeros, in order
    assert [b for b, _ in owner.sent] == [0, 1, 2, 0, 1, 2]
    assert all(float(t.abs().sum()) == 0 for _, t in owner.sent[3:])


def test_owner_held_weakly_and_detach():
    owner, core = make(torch.float32, [0], [0], [4], [4], bucket_elements=4)
    hook = core.hook(0)
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is None
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    hook(p)  # inert: the owner is gone
    assert p.grad is not None and not core.started
    owner2, core2 = make(torch.float32, [0], [0], [4], [4], bucket_elements=4)
    core2.detach()
    core2.hook(0)(p)
    assert owner2.sent == [] and p.grad is not None


def test_owner_errors_propagate():
    class Failing(Owner):
        def _send_bucket(self, b, tensor):
            raise RuntimeError("collective failed")

    owner = Failing(torch.float32)
    owner.sizes = {0: 4}
    core = GradBuckets([0], [0], [4], [4], 4, owner=owner, dtype=torch.float32,
                       tensor_type=torch.Tensor, strided=torch.strided)
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    with pytest.raises(RuntimeError, match="collective failed"):
        core.hook(0)(p)


def test_bad_arguments_are_named():
    owner = Owner(torch.float32)
    kw = dict(owner=owner, dtype=torch.float32, tensor_type=torch.Tensor,
              strided=torch.strided)
    with pytest.raises(ValueError, match="inside its unit"):
        GradBuckets([0], [2], [4], [5], 4, **kw)  # [2, 6) past a span of 5
    with pytest.raises(ValueError, match="bucket_elements"):
        GradBuckets([0], [0], [4], [4], 0, **kw)
    with pytest.raises(ValueError, match="share an element"):
        GradBuckets([0, 0], [0, 2], [4, 4], [8], 4, **kw)  # [0, 4) and [2, 6)
    with pytest.raises(ValueError, match="one length"):
        GradBuckets([0, 0], [0], [4], [4], 4, **kw)
    with pytest.raises(TypeError, match="param_offsets"):
        GradBuckets([0], ["a"], [4], [4], 4, **kw)
    with pytest.raises(ValueError, match="dtype must be"):
        GradBuckets([0], [0], [4], [4], 4, **{**kw, "dtype": torch.int64})
    # more buckets than a plan may have: refused at once (2^62 elements in
    # buckets of one were walked one by one, holding the GIL for good)
    with pytest.raises(ValueError, match=r"bucket_elements 1 cuts these units into more "
                                         r"than 16777216 buckets"):
        GradBuckets([0], [0], [1], [2 ** 62], 1, **kw)
    core = GradBuckets([0], [0], [4], [4], 4, **kw)
    with pytest.raises(ValueError, match="one byte per parameter"):
        core.reset(b"\x01\x01")
    with pytest.raises(IndexError):
        core.hook(1)
    with pytest.raises(IndexError):
        core.bucket(1)
    with pytest.raises(IndexError):
        core.bucket_units(1)
    with pytest.raises(TypeError):
        core.hook(0)()  # a hook takes the parameter
    # the chunks of [Note: small units share a bucket]
    with pytest.raises(ValueError, match="one part per unit"):
        GradBuckets([0], [0], [4], [4], 4, unit_parts=[2, 2], chunks=2, **kw)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        GradBuckets([0], [0], [4], [4], 4, unit_parts=[2], chunks=0, **kw)
    with pytest.raises(ValueError, match="cover its span"):
        GradBuckets([0], [0], [4], [4], 4, unit_parts=[1], chunks=2, **kw)
    with pytest.raises(TypeError, match="unit_parts must hold ints"):
        GradBuckets([0], [0], [4], [4], 4, unit_parts=["a"], chunks=2, **kw)
    with pytest.raises(TypeError, match="missing required keyword argument 'owner'"):
        GradBuckets([0], [0], [4], [4], 4, **{k: v for k, v in kw.items() if k != "owner"})


def test_small_units_share_a_bucket_rank_major():
    """Three units of 2 chunks (parts 3, 2, 2) in one bucket of 14:
    segment r is chunk r of units 0, 1, 2; each gradient lands at its place
    in its chunk's segment, the padding zeroed ([Note: small units share a
    bucket] in csrc/zero.h)."""
    owner = Owner(torch.float32)
    owner.sizes = {0: 14}
    kw = dict(owner=owner, dtype=torch.float32, tensor_type=torch.Tensor,
              strided=torch.strided)
    # unit 0: a [0, 5); unit 1: b [0, 4); unit 2: c [0, 3)
    core = GradBuckets([0, 1, 2], [0, 0, 0], [5, 4, 3], [5, 4, 3], 14,
                       unit_parts=[3, 2, 2], chunks=2, **kw)
    assert core.count == 1 and core.bucket(0) == (0, 0, 14) and core.bucket_units(0) == (0, 2)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 4, 3)]
    for i in (2, 1, 0):
        params[i].grad = torch.arange(1.0, params[i].numel() + 1) * 10 ** i
        core.hook(i)(params[i])
    (b, sent), = owner.sent
    want = torch.tensor([1, 2, 3, 10, 20, 100, 200,  # chunk 0 of units 0, 1, 2
                         4, 5, 0, 30, 40, 300, 0])    # chunk 1, padding zeroed
    assert b == 0 and torch.equal(sent, want.float()), sent


class _ClearsItsList:
    """An int whose __index__ empties the list it sits in (the C side read
    the list's items through pointers the clear freed: a segfault)."""

    def __init__(self, holder, value):
        self.holder, self.value = holder, value

    def __index__(self):
        self.holder.clear()
        return self.value


def test_lists_changed_while_read_are_read_as_given():
    units = []
    units.extend([_ClearsItsList(units, 0)] + [0] * 7)
    core = GradBuckets(units, [0, 1, 2, 3, 4, 5, 6, 7], [1] * 8, [8], 4,
                       owner=Owner(torch.float32), dtype=torch.float32,
                       tensor_type=torch.Tensor, strided=torch.strided)
    assert core.count == 2  # the 8 parameters as they were passed
    numels = []
    numels.extend([_ClearsItsList(numels, 5)] + [1 << 20] * 7)
    assert _C.cuda_norm_partials(numels) == \
        _C.cuda_norm_partials([5] + [1 << 20] * 7)
