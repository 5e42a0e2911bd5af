"""Pipeline parallelism in one process: how split_gpt shares the layers
among stages, a one-stage pipeline (pp of size 1) trained through torch's
schedule as plain torch trains the model, a rank's several stages held by
one StageChunks (the model's names, each chunk the stage it is), and the
refusals (a stage without a pp mesh, on another stage than the mesh says,
bad schedule arguments, several stages a rank without a pp dimension).
Several stages: tests/distributed/test_pipeline_parallel.py."""
import os
import sys

import pytest
import torch

import zero
from conftest import max_rel_error
from engine_cases import user_group_of_one
from zero.parallel._pipeline import GPTStage, layer_range
from zero.parallel._virtual_stages import StageChunks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab=32, dim=16, layers=3, heads=2, seq=8)


@pytest.mark.parametrize("layers, count", [(4, 2), (5, 2), (7, 3), (3, 3)])
def test_layer_ranges_cover_the_layers_once(layers, count):
    ranges = [layer_range(layers, i, count) for i in range(count)]
    assert [i for r in ranges for i in r] == list(range(layers))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


def test_more_stages_than_layers_are_refused():
    with pytest.raises(ValueError, match="3 pipeline stages for 2 layers"):
        layer_range(2, 0, 3)


def test_stages_keep_the_names_and_copy_a_tied_head():
    def model():
        torch.manual_seed(0)
        return GPT(CFG)
    whole = dict(model().named_parameters())
    first, last = GPTStage(model(), 0, 2), GPTStage(model(), 1, 2)
    names = set(dict(first.named_parameters())) | set(dict(last.named_parameters()))
    assert names == set(whole) | {"head.weight"}  # the copy, under the head's name
    assert last._zero_pipeline.ties == {"head.weight": "embed.weight"}
    assert first._zero_pipeline.ties == {"embed.weight": "embed.weight"}
    assert torch.equal(last.head.weight, first.embed.weight)
    one = GPTStage(model(), 0, 1)  # one stage: the tie itself, no copy
    assert one.head.weight is one.embed.weight and one._zero_pipeline.ties == {}


def test_stage_chunks_hold_their_stages_under_the_models_names():
    """pp=2 with two stages a rank: rank 1 holds stages 1 and 3 of 4 (GPT of
    4 layers: blocks 1 and 3, and the last stage's norm and tied head)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=32, dim=16, layers=4, heads=2, seq=8))
    whole = dict(model.named_parameters())
    stages = [GPTStage(model, 1, 4), GPTStage(model, 3, 4)]
    chunks = StageChunks(stages, 1, 2)
    names = set(dict(chunks.named_parameters()))
    assert names == {n for n in whole if n.startswith(("blocks.1.", "blocks.3.", "ln."))} | \
        {"head.weight"}
    assert chunks._zero_pipeline.ties == {"head.weight": "embed.weight"}
    assert (chunks._zero_pipeline.index, chunks._zero_pipeline.count) == (1, 2)
    assert chunks._zero_stage_indices == (1, 3)
    x = torch.randn(2, CFG.seq, CFG.dim)
    assert torch.equal(chunks(x, chunk=0), model.blocks[1](x))
    assert torch.equal(chunks(x, chunk=1), stages[1].head(stages[1].ln(model.blocks[3](x))))
    # each stage keeps its own blocks
    assert list(stages[0].blocks) == ["1"] and list(stages[1].blocks) == ["3"]


@pytest.fixture
def one_process_group(monkeypatch):
    with user_group_of_one(monkeypatch):
        yield


def _pp_mesh():
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh("cpu", [[0]], mesh_dim_names=("pp", "dp_shard"))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_stage_trains_as_plain_torch(one_process_group, schedule):
    torch.manual_seed(0)
    reference = GPT(CFG)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch.manual_seed(0)
    mesh = _pp_mesh()
    stage = zero.parallel.split_gpt(GPT(CFG), mesh["pp"])
    engine = zero.initialize(stage, optimizer=torch.optim.SGD(stage.parameters(), lr=0.1),
                             stage=2, mesh=mesh)
    pipe = zero.parallel.pipeline_schedule(engine, mesh["pp"], 2, zero.parallel.gpt_loss,
                                           schedule)
    for step in range(3):
        ids = torch.randint(0, CFG.vocab, (4, CFG.seq),
                            generator=torch.Generator().manual_seed(step))
        labels = torch.roll(ids, -1, 1)
        losses = []
        pipe.step(ids, target=labels, losses=losses)
        engine.step()
        ref_loss = reference(ids, labels)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(sum(x.item() for x in losses) - ref_loss.item()) < 1e-5
    state = engine.full_state_dict()
    engine.close()
    for name, value in reference.state_dict().items():
        assert max_rel_error(state[name], value) < 1e-5, name


def test_micro_batches_must_be_equal(one_process_group):
    """A batch that does not split evenly is refused before torch runs it
    (each micro-batch's loss is divided by their count); on one stage a
    later batch may have another shape (nothing is sent)."""
    mesh = _pp_mesh()
    stage = zero.parallel.split_gpt(GPT(CFG), mesh["pp"])
    engine = zero.initialize(stage, optimizer=torch.optim.SGD(stage.parameters(), lr=0.1),
                             stage=1, mesh=mesh)
    pipe = zero.parallel.pipeline_schedule(engine, mesh["pp"], 2, zero.parallel.gpt_loss)
    before = [p.detach().clone() for p in stage.parameters()]
    for size in (4, 6):
        ids = torch.randint(0, CFG.vocab, (size, CFG.seq))
        pipe.step(ids, target=ids, losses=[])
        engine.step()
    moved = [p.detach().clone() for p in stage.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, moved))
    ids = torch.randint(0, CFG.vocab, (5, CFG.seq))
    with pytest.raises(ValueError, match=r"args\[0\] has shape \(5, 8\).* 2 micro-batches"):
        pipe.step(ids, target=ids[:4], losses=[])
    with pytest.raises(ValueError, match=r"target= has shape \(5, 8\)"):
        pipe.step(ids[:4], target=ids, losses=[])
    assert all(torch.equal(a, b) for a, b in zip(moved, stage.parameters()))
    engine.close()


def test_micro_batch_shapes_between_stages_keep_the_first_steps():
    from zero.parallel._micro_batches import MicroBatchShapes
    shapes = MicroBatchShapes(2, sends=True)
    shapes.check((torch.zeros(4, 8),), {"mask": torch.zeros(4, 8), "return_outputs": False})
    shapes.check((torch.zeros(4, 8),), {"mask": torch.zeros(4, 8)})
    with pytest.raises(ValueError, match=r"args\[0\] gives micro-batches of shape \(3, 8\), "
                                         r"the first step's were \(2, 8\)"):
        shapes.check((torch.zeros(6, 8),), {})
    with pytest.raises(ValueError, match=r"mask= gives micro-batches of shape \(2, 7\)"):
        shapes.check((torch.zeros(4, 8),), {"mask": torch.zeros(4, 7)})
    with pytest.raises(ValueError, match="does not split into 2"):
        shapes.check((torch.zeros(3, 8),), {})


def test_refusals(one_process_group):
    from torch.distributed.device_mesh import DeviceMesh
    mesh = _pp_mesh()
    stage = zero.parallel.split_gpt(GPT(CFG), mesh["pp"])
    with pytest.raises(ValueError, match="is a pipeline stage .* no 'pp' dimension"):
        zero.initialize(stage, stage=1, mesh=DeviceMesh("cpu", [0], mesh_dim_names=("dp_shard",)))
    other = GPTStage(GPT(CFG), 1, 2)
    with pytest.raises(ValueError, match="stage 1 of 2, but this rank is stage 0 of 1"):
        zero.initialize(other, stage=1, mesh=mesh)
    engine = zero.initialize(stage, stage=1, mesh=mesh, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1"):
        zero.parallel.pipeline_schedule(engine, mesh["pp"], 2, zero.parallel.gpt_loss)
    with pytest.raises(ValueError, match="schedule must be one of"):
        zero.parallel.pipeline_schedule(engine, mesh["pp"], 2, zero.parallel.gpt_loss, "zb")
    with pytest.raises(ValueError, match="those take a model split with stages_per_rank > 1"):
        zero.parallel.pipeline_schedule(engine, mesh["pp"], 2, zero.parallel.gpt_loss,
                                        "interleaved-1f1b")
    from torch.distributed.pipelining import ScheduleInterleaved1F1B
    with pytest.raises(ValueError, match="not a PipelineScheduleSingle subclass"):
        zero.parallel.pipeline_schedule(engine, mesh["pp"], 2, zero.parallel.gpt_loss,
                                        ScheduleInterleaved1F1B)
    engine.close()
    with pytest.raises(ValueError, match="needs a pp dimension of at least 2 ranks"):
        zero.parallel.split_gpt(GPT(CFG), mesh["pp"], stages_per_rank=2)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="stages_per_rank must be a positive integer"):
            zero.parallel.split_gpt(GPT(CFG), mesh["pp"], stages_per_rank=bad)
