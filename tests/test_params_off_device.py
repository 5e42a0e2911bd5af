"""Stage 3's parameter offload for a model on a GPU (offload_param "cpu" or
"nvme": the shard in host memory or a file, each unit's chunk copied to
the device before its gather), run on the CPU.

Only a GPU model takes this path. Here params_off_device is made true for
a CPU model, so the same code runs with the "device" and the host both the
CPU: every copy it makes (the shard's chunk to the device before a gather,
a reduced gradient portion to the host partition, the new parameters from
the master into the host shard) is a real copy between separate buffers.
The values are the same and the update is the same C code over them, so a
run must equal in-memory stage 3 bit for bit. Tolerance: none. Several
ranks: tests/distributed/test_params_off_device_ranks.py; on a GPU:
tests/gpu/test_engine.py."""
import pytest
import torch

import zero
import zero.offload._param_staging as param_staging
import zero.sharding._flat_group
import zero.step._step_path as step_path
from engine_cases import (Net, apart_on_the_cpu, assert_checkpoint_chain_exact,
                          assert_same_finish, batches, finish, loss_of, no_launcher,
                          offload_options)

STAGING_CHUNK = 512  # several chunks a partition: the write-back and the windows loop


@pytest.fixture(autouse=True)
def _offloaded_on_the_cpu(monkeypatch):
    no_launcher(monkeypatch)
    monkeypatch.setattr(param_staging, "params_off_device", apart_on_the_cpu)
    monkeypatch.setattr(step_path, "states_off_device", apart_on_the_cpu)
    monkeypatch.setattr(zero.sharding._flat_group, "STAGING_CHUNK", STAGING_CHUNK)


def run(precision, steps=3, accumulation=2, clip=0.5, **options):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # a threshold under the smallest module: every unit is gathered and
    # released, none kept whole
    engine = zero.initialize(model, optimizer=optimizer, stage=3, precision=precision,
                             gradient_clipping=clip, gradient_accumulation_steps=accumulation,
                             stage3_param_persistence_threshold=0, **options)
    for tokens, targets in batches("cpu", steps * accumulation):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    return engine


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("params,states", [("cpu", None), ("nvme", None), ("cpu", "cpu"),
                                           ("nvme", "nvme"), ("cpu", "nvme")])
def test_offloaded_run_equals_stage3_in_memory(tmp_path, precision, params, states):
    expected = finish(run(precision, **offload_options(tmp_path, None, states)))
    engine = run(precision, **offload_options(tmp_path, params, states))
    for fg in engine.all_groups:
        assert fg.shard_on_host and fg.copier is not None
        assert fg.master is not fg.shard  # fp32 too: the master is the device's
        assert fg.grads_on_host == (states is not None and fg.trainable)
        if states is not None:  # read and written in place: no windows for them
            assert fg.host_windows == {}
    # every gather went through a copy of this rank's chunk
    assert engine._copier.take_bytes() > 0
    assert_same_finish(finish(engine), expected)


def test_without_clipping_and_accumulation(tmp_path):
    """The gradient norm is then not taken: the host partition is read
    only by the update."""
    expected = finish(run("bf16", accumulation=1, clip=0.0,
                          **offload_options(tmp_path, None, "cpu")))
    got = finish(run("bf16", accumulation=1, clip=0.0,
                     **offload_options(tmp_path, "cpu", "cpu")))
    assert_same_finish(got, expected)


def test_the_gather_reads_a_copy_not_the_shard(monkeypatch, tmp_path):
    """Each gather's source is a buffer of its own holding this rank's
    chunk, never the host shard itself."""
    engine = run("bf16", steps=1, **offload_options(tmp_path, "cpu", None))
    sources = []
    real = engine._comm.all_gather_into

    def spy(output, shard, async_op=False):
        sources.append(shard)
        return real(output, shard, async_op=async_op)
    monkeypatch.setattr(engine._comm, "all_gather_into", spy)
    tokens, targets = batches("cpu", 1)[0]
    engine.backward(loss_of(engine(tokens), targets))
    shards = [fg.shard for fg in engine.all_groups]
    assert sources
    for source in sources:
        assert all(source.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
                   for s in shards)
    engine.close()


@pytest.mark.parametrize("states", [None, "cpu"])
def test_memory_summary_puts_the_shard_on_the_host(tmp_path, states):
    engine = run("bf16", steps=1, **offload_options(tmp_path, "cpu", states))
    summary = engine.memory_summary()
    shard = sum(fg.shard.nbytes for fg in engine.all_groups)
    grads = sum(fg.grad_part.nbytes for fg in engine.groups)
    master_and_states = sum(4 * fg.part_size * (1 + len(fg.states)) for fg in engine.groups)
    assert summary["params"] == 0  # nothing gathered, nothing persistent
    if states is None:
        assert summary["host"] == shard
        assert summary["grads"] == grads
        assert summary["optimizer_states"] == master_and_states
    else:
        assert summary["host"] == shard + grads + master_and_states
        assert summary["grads"] == summary["optimizer_states"] == 0
    assert "host memory" in summary["formula"]
    estimate = zero.estimate_memory(Net(), stage=3, precision="bf16", device="cuda",
                                    stage3_param_persistence_threshold=0,
                                    **offload_options(tmp_path, "cpu", states))
    for key in ("params", "grads", "optimizer_states", "host", "params_offloaded"):
        assert estimate[key] == summary[key], key
    # the same but for stage 3's gathered peak, which only a run knows
    assert estimate["formula"].split("; ")[1:] == summary["formula"].split("; ")[1:]
    engine.close()


def test_gathered_parameters_write_reaches_the_host_shard(tmp_path):
    """A weight changed under zero.GatheredParameters(modifier_rank=0) is
    kept in the host shard and in the master: the next forward sees it."""
    expected_run = run("fp32", steps=1, **offload_options(tmp_path, None, None))
    engine = run("fp32", steps=1, **offload_options(tmp_path, "cpu", None))
    for e in (expected_run, engine):
        with zero.GatheredParameters([e.module.head.weight], modifier_rank=0):
            with torch.no_grad():
                e.module.head.weight[3].fill_(0.25)
        for tokens, targets in batches("cpu", 2, seed=9):  # one accumulation boundary
            e.backward(loss_of(e(tokens), targets))
            e.step()
    got, expected = finish(engine), finish(expected_run)
    assert torch.all(got[0]["head.weight"][3] != 0.25)  # trained on from there
    assert_same_finish(got, expected)


def test_close_gives_the_parameters_back_in_host_memory(tmp_path):
    engine = run("bf16", steps=1, **offload_options(tmp_path, "cpu", "cpu"))
    full = {k: v.clone() for k, v in engine.full_state_dict().items()}
    model = engine.module
    engine.close()
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and p.numel() > 0
        assert torch.equal(p.detach(), full[name].to(p.dtype)), name  # the master rounded


def test_checkpoint_round_trip_with_the_shard_on_the_host(tmp_path):
    """Saved from an offloaded run, loaded into one; saved again: the
    same weights and states, bit for bit."""
    options = offload_options(tmp_path, "cpu", "cpu")

    def make():
        torch.manual_seed(0)
        model = Net()
        return zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                               stage=3, precision="bf16", **options)

    def first():
        engine = make()
        for tokens, targets in batches("cpu", 2):
            engine.backward(loss_of(engine(tokens), targets))
            engine.step()
        return engine

    assert_checkpoint_chain_exact(tmp_path / "ckpt", first, make, make)
