"""offload_optimizer.delayed_update ([Note: delayed update] in
step/_delayed.py): the host update of step k runs on a thread while step
k+1's forward and backward run, so each update lands one step late.

Only a GPU model takes the staged step; here states_off_device is made
true for a CPU model, so the same code runs on the CPU with real copies.
The reference is plain torch applying each update one step late: a
master model w stepped by torch's optimizer and a model v the loss is
computed with, per boundary
    g = grad(v); v = w; w = update(w, g)
fp32, compared within 1e-5 (engine_cases: the same ops forward and
backward, the update's rounding a few ulps a step)."""
import copy

import pytest
import torch
from torch import nn

import zero
import zero.step._step_path as step_path
from conftest import max_rel_error
from engine_cases import (ACCUMULATION, Net, apart_on_the_cpu, batches, engine_run, loss_of,
                          make_optimizer, no_launcher)

STEPS = 5
CLIP = 0.5
REAL_STATES_OFF_DEVICE = step_path.states_off_device


@pytest.fixture(autouse=True)
def _staged_on_the_cpu(monkeypatch):
    no_launcher(monkeypatch)
    monkeypatch.setattr(step_path, "states_off_device", apart_on_the_cpu)


def delayed_engine(stage, optimizer="adamw", offload="cpu", tmp_path=None, **options):
    torch.manual_seed(0)
    model = Net()
    block = {"device": offload, "delayed_update": True}
    if offload == "nvme":
        block.update(nvme_path=str(tmp_path), chunk_elements=1024)
    return zero.initialize(model, optimizer=make_optimizer(optimizer, model.parameters()),
                           stage=stage, gradient_accumulation_steps=ACCUMULATION,
                           gradient_clipping=CLIP, stage3_param_persistence_threshold=0,
                           offload_optimizer=block, **options)


def one_step_late_reference(optimizer, data):
    """(w, v) after the boundaries of `data`, torch only."""
    torch.manual_seed(0)
    w = Net()
    v = copy.deepcopy(w)
    opt = make_optimizer(optimizer, w.parameters())
    for i, (tokens, targets) in enumerate(data):
        (loss_of(v(tokens), targets) / ACCUMULATION).backward()
        if (i + 1) % ACCUMULATION == 0:
            nn.utils.clip_grad_norm_(v.parameters(), CLIP)
            for pw, pv in zip(w.parameters(), v.parameters()):
                pw.grad = pv.grad.clone()
                pv.grad = None
            v.load_state_dict(w.state_dict())  # v = w, before this update
            opt.step()
            opt.zero_grad()
    return w, v


def assert_close(got: dict, expected: nn.Module, what):
    for name, value in expected.state_dict().items():
        error = max_rel_error(got[name].float(), value)
        assert error <= 1e-5, f"{what}: {name} off by {error:.2e}"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd_nesterov"])
def test_each_update_lands_one_step_late(stage, optimizer):
    data = batches("cpu", STEPS * ACCUMULATION)
    w, v = one_step_late_reference(optimizer, data)
    engine = delayed_engine(stage, optimizer)
    engine_run(engine, data)
    assert engine._delayed.pending
    if stage < 3:  # the parameters computed with: the update before last
        assert_close({n: p.detach() for n, p in engine.module.named_parameters()}, v,
                     f"stage {stage} visible")
    # full_state_dict lands the last update first
    assert_close(engine.full_state_dict(), w, f"stage {stage} master")
    assert not engine._delayed.pending
    engine.close()


def test_without_delay_the_reference_differs():
    """The reference is not the plain run (the test could not fail
    otherwise): one step late changes the result well beyond 1e-5."""
    data = batches("cpu", STEPS * ACCUMULATION)
    w, _ = one_step_late_reference("adamw", data)
    torch.manual_seed(0)
    model = Net()
    engine = zero.initialize(model, optimizer=make_optimizer("adamw", model.parameters()),
                             stage=2, gradient_accumulation_steps=ACCUMULATION,
                             gradient_clipping=CLIP, offload_optimizer={"device": "cpu"})
    engine_run(engine, data)
    full = engine.full_state_dict()
    engine.close()
    assert max(max_rel_error(full[n], t) for n, t in w.state_dict().items()) > 1e-3


def test_states_in_files(tmp_path):
    data = batches("cpu", STEPS * ACCUMULATION)
    w, _ = one_step_late_reference("adamw", data)
    engine = delayed_engine(3, offload="nvme", tmp_path=tmp_path)
    assert all(fg.offload.maps for fg in engine.groups)
    engine_run(engine, data)
    assert_close(engine.full_state_dict(), w, "nvme")
    engine.close()


def test_the_first_forward_after_a_step_sees_the_parameters_before_it():
    engine = delayed_engine(2)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine_run(engine, batches("cpu", ACCUMULATION))
    for n, p in engine.module.named_parameters():  # update 1 is in flight
        assert torch.equal(p.detach(), before[n]), n
    for tokens, targets in batches("cpu", ACCUMULATION, seed=5):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    assert any(not torch.equal(p.detach(), before[n])
               for n, p in engine.module.named_parameters())  # update 1 landed
    engine.close()


def test_a_checkpoint_holds_every_update(tmp_path):
    """save_checkpoint lands the pending update: a plain engine loading it
    has the one-step-late reference's master."""
    data = batches("cpu", STEPS * ACCUMULATION)
    w, _ = one_step_late_reference("adamw", data)
    engine = delayed_engine(2)
    engine_run(engine, data)
    engine.save_checkpoint(tmp_path)
    engine.close()
    torch.manual_seed(1)
    model = Net()
    plain = zero.initialize(model, optimizer=make_optimizer("adamw", model.parameters()),
                            stage=1)
    plain.load_checkpoint(tmp_path)
    assert plain.global_steps == STEPS
    assert_close(plain.full_state_dict(), w, "loaded")
    plain.close()


def test_load_checkpoint_drops_the_pending_update(tmp_path):
    engine = delayed_engine(1)
    engine.save_checkpoint(tmp_path / "start")
    saved = engine.full_state_dict()
    engine_run(engine, batches("cpu", ACCUMULATION))
    assert engine._delayed.pending
    engine.load_checkpoint(tmp_path / "start")
    assert not engine._delayed.pending and engine.global_steps == 0
    for name, value in engine.full_state_dict().items():
        assert torch.equal(value, saved[name]), name
    engine.close()


def test_close_hands_back_the_model_with_every_update():
    data = batches("cpu", STEPS * ACCUMULATION)
    w, _ = one_step_late_reference("adamw", data)
    engine = delayed_engine(3)
    engine_run(engine, data)
    model = engine.module
    engine.close()
    assert_close({n: p.detach() for n, p in model.named_parameters()}, w, "closed")


def test_a_write_in_gathered_parameters_lands_after_the_update():
    engine = delayed_engine(3)
    engine_run(engine, batches("cpu", ACCUMULATION))
    with zero.GatheredParameters([engine.module.head.bias], modifier_rank=0):
        assert not engine._delayed.pending  # landed on entry
        with torch.no_grad():
            engine.module.head.bias.fill_(0.125)
    assert torch.all(engine.full_state_dict()["head.bias"] == 0.125)
    engine.close()


def test_a_write_before_a_modifier_block_is_refused_while_an_update_is_pending():
    """The block's agreement leaves a listed parameter's earlier write to
    the modifier's values; with an update pending it must still refuse it
    (the update lands over it), as a step does: it was dropped without a
    word (review). Stage 2: at stage 3 the released parameter's write is
    refused as such."""
    engine = delayed_engine(2)
    engine_run(engine, batches("cpu", ACCUMULATION))
    assert engine._delayed.pending
    with torch.no_grad():
        engine.module.head.bias.fill_(0.125)
    with pytest.raises(RuntimeError, match="delayed_update: parameter.*head.bias.*dropped"):
        with zero.GatheredParameters([engine.module.head.bias], modifier_rank=0):
            pass
    engine.close()


def test_an_in_place_write_between_steps_is_refused_and_dropped():
    engine = delayed_engine(2)
    engine_run(engine, batches("cpu", ACCUMULATION))
    with torch.no_grad():
        engine.module.head.weight.mul_(2.0)
    for tokens, targets in batches("cpu", ACCUMULATION, seed=3):
        engine.backward(loss_of(engine(tokens), targets))
        if not engine.is_accumulation_boundary:
            engine.step()
    with pytest.raises(RuntimeError, match="delayed_update: parameter.*head.weight.*dropped"):
        engine.step()
    # dropped from the live parameter too, the pending update landed: the
    # next forward computes with the engine's values (it used the write)
    live = engine.module.head.weight.detach().clone()
    engine.zero_grad()
    assert torch.equal(live, engine.full_state_dict()["head.weight"].to(live.dtype))
    for tokens, targets in batches("cpu", ACCUMULATION, seed=4):  # goes on
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    assert engine.global_steps == 2
    engine.close()


def test_a_failure_in_the_thread_is_raised_where_the_update_lands(monkeypatch):
    engine = delayed_engine(2)

    def fail(*_args, **_kwargs):
        raise OSError(5, "offload_optimizer: simulated read error")
    monkeypatch.setattr(engine.step_path, "update_delayed", fail)
    engine_run(engine, batches("cpu", ACCUMULATION))
    with pytest.raises(OSError, match="simulated read error"):
        engine.full_state_dict()
    assert not engine._delayed.pending
    engine.close()


def test_an_interrupted_wait_can_be_waited_for_again(monkeypatch):
    """Ctrl-C while step() waits for the update: the thread goes on, and
    the next wait waits for it. Thread.join() interrupted marked the
    thread stopped in CPython 3.11, so the next wait returned at once and
    a second update ran beside the first (a segfault on the offload
    windows, or other weights)."""
    import signal
    import threading
    import time
    from zero.step._delayed import DelayedUpdate
    release = threading.Event()
    updates = []

    class SlowPath:
        def update_delayed(self, *args):
            release.wait(10)
            updates.append(args[-1])

    class Group:
        index, step_count = 0, 0

        def hand_grads_to_delayed(self):
            pass

    class Spec:
        @staticmethod
        def counts_as_step(group):
            return 1

    class Optimizer:
        param_groups = [{"lr": 0.1}]

    delayed = DelayedUpdate(SlowPath())
    delayed.launch(Spec, Optimizer, [Group()], 1.0)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.2, lambda: signal.pthread_kill(threading.main_thread().ident,
                                                         signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            delayed.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert delayed._thread.is_alive() and updates == []
    threading.Timer(0.2, release.set).start()
    started = time.monotonic()
    assert delayed.wait() is None
    assert time.monotonic() - started >= 0.1  # it waited for the update
    assert updates == [1] and delayed.pending
    assert [t for t in threading.enumerate() if t.name == "zero-delayed-update"] == []


def test_memory_summary_and_estimate_count_the_two_partitions():
    engine = delayed_engine(2, precision="bf16")
    summary = engine.memory_summary()
    part = sum(fg.part_size for fg in engine.groups)
    master_and_states = 4 * part * 3
    assert summary["host"] == master_and_states + part * (2 + 2)
    estimate = zero.estimate_memory(Net(), stage=2, precision="bf16", device="cuda",
                                    offload_optimizer={"device": "cpu",
                                                       "delayed_update": True})
    assert estimate["host"] == summary["host"]
    engine.close()


def test_refusals():
    with pytest.raises(ValueError, match="delayed_update needs the states apart"):
        zero.Config(offload_optimizer={"device": "none", "delayed_update": True})
    with pytest.raises(ValueError, match="delayed_update must be True or False"):
        zero.Config(offload_optimizer={"device": "cpu", "delayed_update": 1})


def test_a_cpu_model_is_refused(monkeypatch):
    monkeypatch.setattr(step_path, "states_off_device", lambda device, offload: False)
    model = Net()
    with pytest.raises(ValueError, match="delayed_update .* the model is on cpu"):
        zero.initialize(model, stage=2,
                        offload_optimizer={"device": "cpu", "delayed_update": True})
    assert all(p.numel() > 0 for p in model.parameters())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_cpu_model_with_states_in_files(tmp_path, monkeypatch, stage):
    """A model on the CPU (not staged): the thread's disk reads and writes
    overlap the next forward and backward; the parameters are then not the
    fp32 master, which the thread writes."""
    monkeypatch.setattr(step_path, "states_off_device", REAL_STATES_OFF_DEVICE)
    data = batches("cpu", STEPS * ACCUMULATION)
    w, v = one_step_late_reference("adamw", data)
    engine = delayed_engine(stage, offload="nvme", tmp_path=tmp_path)
    assert isinstance(engine.step_path, step_path.HostStep)
    for fg in engine.groups:
        assert fg.master is not fg.shard and fg.offload.maps
    engine_run(engine, data)
    if stage < 3:
        assert_close({n: p.detach() for n, p in engine.module.named_parameters()}, v,
                     f"stage {stage} visible")
    summary = engine.memory_summary()
    assert_close(engine.full_state_dict(), w, f"stage {stage} master")
    engine.close()
    estimate = zero.estimate_memory(Net(), stage=stage, gradient_accumulation_steps=2,
                                    stage3_param_persistence_threshold=0,
                                    offload_optimizer={"device": "nvme", "chunk_elements": 1024,
                                                       "nvme_path": str(tmp_path),
                                                       "delayed_update": True})
    for key in ("params", "grads", "optimizer_states", "offloaded", "host"):
        assert estimate[key] == summary[key], key


def test_a_process_that_ends_with_an_update_in_flight_exits_cleanly(tmp_path):
    """The thread is not a daemon: the interpreter waits for it at exit
    (a daemon thread inside the C core or torch then aborted the process:
    "terminate called without an active exception")."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent(f"""
        import torch, zero
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()),
                                 stage=3, precision="bf16", offload_optimizer={{
                                     "device": "nvme", "nvme_path": {str(tmp_path)!r},
                                     "write_through": True, "delayed_update": True}})
        for _ in range(3):
            engine.backward(engine(torch.randn(4, 512)).float().square().mean())
            engine.step()
        assert engine._delayed.pending
        print("left with an update in flight", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in __import__("os").environ.items()
                                            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                         "MASTER_PORT", "LOCAL_RANK")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left with an update in flight" in done.stdout
