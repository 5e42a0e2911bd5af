"""torch.compile with the engine, in one process, stages 0-3 with every
stage-3 unit released: zero.initialize(torch.compile(model)) and
`engine.module = torch.compile(engine.module)` after initialize train as
plain torch does, and their checkpoints keep the model's names (the
wrapper's '_orig_mod.' made them unreadable), loading back and
consolidating to a plain state dict. Before, the first at stage 3 failed
inside dynamo at the first forward. The eager backend (dynamo's tracing
and graph breaks, without inductor's code generation) keeps it fast;
inductor once, at stage 3."""
import pytest
import torch
from torch import nn

import zero
from conftest import max_rel_error


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


CASES = [(stage, when, "eager") for stage in (0, 1, 2, 3) for when in ("before", "after")] + \
    [(3, "before", "inductor")]


@pytest.mark.parametrize("stage, when, backend", CASES)
def test_a_compiled_model_trains_and_checkpoints_as_the_model(tmp_path, stage, when, backend):
    torch._dynamo.reset()
    reference = model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    given = torch.compile(net, backend=backend) if when == "before" else net
    engine = zero.initialize(given, optimizer=optimizer, stage=stage,
                             stage3_param_persistence_threshold=0)
    if when == "after":
        engine.module = torch.compile(engine.module, backend=backend)
    for step in range(3):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
        reference(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    engine.save_checkpoint(tmp_path)
    state = zero.checkpoint.consolidate(tmp_path)["model"]
    assert sorted(state) == sorted(reference.state_dict())
    for name, value in reference.state_dict().items():
        assert max_rel_error(state[name], value) < 1e-5, name
    engine.load_checkpoint(tmp_path)  # read back into the compiled engine
    full = engine.full_state_dict()
    assert all(torch.equal(full[k], state[k]) for k in state)
    engine.close()


@pytest.mark.parametrize("stage, when", [(2, "after"), (3, "before"), (3, "after")])
def test_a_whole_graph_compile_is_refused_with_a_note_naming_zero(stage, when):
    """torch.compile(..., fullgraph=True): the engine's hooks must run as
    Python between graphs, and dynamo's error named torch's `disable` and
    asked for a torch issue (compile hunt). It now carries a note naming
    zero's hooks and the way out; at stages 0-1 the model compiles whole."""
    torch._dynamo.reset()
    net = model()
    given = torch.compile(net, backend="eager", fullgraph=True) if when == "before" else net
    engine = zero.initialize(given, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                             stage=stage)
    if when == "after":
        engine.module = torch.compile(engine.module, backend="eager", fullgraph=True)
    with pytest.raises(RuntimeError) as raised:
        engine(torch.randn(6, 8))
    assert any("torch.compile(..., fullgraph=True) cannot take in the engine's module hooks"
               in note and "fullgraph=False" in note
               for note in getattr(raised.value, "__notes__", [])), raised.value
    engine.close()
    torch._dynamo.reset()
    whole = zero.initialize(torch.compile(model(), backend="eager", fullgraph=True), stage=1)
    whole.backward(whole(torch.randn(6, 8)).square().mean())
    whole.step()
    whole.close()
