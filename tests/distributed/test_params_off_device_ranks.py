"""Stage 3's parameter offload for a GPU model (offload_param "cpu" or
"nvme", the shard in host memory or a file and each unit's chunk copied to
the device before its gather) on 2 and 3 gloo ranks, run on the CPU as
tests/test_params_off_device.py does in one process: params_off_device is
made true, so every copy is a real one between separate buffers.

Each rank trains the same model in memory and with the shard off the
"device", alone and with offload_optimizer (the gradient partition then
on the host too), fp32 and bf16, with clipping (the norm summed over
ranks) and accumulation; the model has a frozen layer (stage 3's group of
frozen parameters, gathered through the same copies) and two param
groups. The values and the C update are the same, so the runs must agree
bit for bit. Tolerance: none."""
import tempfile

import pytest
import torch
from torch import nn

import harness

WORLDS = [2, 3]
STEPS = 3


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(37, 64)
        self.frozen = nn.Linear(64, 64)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(64, 51)
        self.out = nn.Linear(51, 7)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.frozen(self.inp(x))))))


def train(rank, world, precision, params=None, states=None):
    with tempfile.TemporaryDirectory(prefix=f"zero-params-r{rank}-") as directory:
        return _train_in(directory, rank, precision, params, states)


def _train_in(directory, rank, precision, params, states):
    import zero
    from engine_cases import offload_options, place_apart
    place_apart(params=params is not None, states=states is not None)
    options = offload_options(directory, params, states)
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(
        [{"params": [*model.inp.parameters(), *model.mid.parameters()]},
         {"params": model.out.parameters(), "lr": 3e-3, "weight_decay": 0.0}],
        lr=1e-2, weight_decay=0.1)
    engine = zero.initialize(model, optimizer=optimizer, stage=3, precision=precision,
                             gradient_clipping=0.5, gradient_accumulation_steps=2,
                             stage3_param_persistence_threshold=0, **options)
    facts = {"on_host": all(fg.shard_on_host for fg in engine.all_groups),
             "grads_on_host": all(fg.grads_on_host for fg in engine.groups),
             "frozen_group": engine.frozen_group is not None}
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        for _ in range(2):
            x = torch.randn(8, 37, generator=g)
            engine.backward(engine(x).float().square().mean())
            engine.step()
    if engine._copier is not None:
        facts["copied"] = engine._copier.take_bytes()
    state = engine.full_state_dict()
    states_out = {(fg.index, k): v.clone() for fg in engine.groups for k, v in fg.states.items()}
    engine.close()
    return state, states_out, facts


def every_way(rank, world):
    runs = {}
    for precision in ("fp32", "bf16"):
        runs[precision] = {
            "memory": train(rank, world, precision),
            "cpu": train(rank, world, precision, params="cpu"),
            "nvme": train(rank, world, precision, params="nvme"),
            "cpu+states": train(rank, world, precision, params="cpu", states="cpu"),
            "nvme+states": train(rank, world, precision, params="nvme", states="nvme"),
        }
    return runs


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def runs(request):
    return request.param, harness.run(request.param, every_way)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("way", ["cpu", "nvme", "cpu+states", "nvme+states"])
def test_offloaded_ranks_equal_stage3_in_memory(runs, precision, way):
    world, results = runs
    for rank, result in enumerate(results):
        where = f"world {world} rank {rank} {precision} {way}"
        state, states, _ = result[precision]["memory"]
        o_state, o_states, facts = result[precision][way]
        assert facts["on_host"] and facts["frozen_group"], where
        assert facts["grads_on_host"] == way.endswith("+states"), where
        assert facts["copied"] > 0, where
        for key, value in state.items():
            assert torch.equal(o_state[key], value), f"{where}: {key}"
        for key, value in states.items():
            assert torch.equal(o_states[key], value), f"{where}: state {key}"
