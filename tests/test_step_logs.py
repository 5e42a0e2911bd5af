"""The config's comms_logger and memory_breakdown (engine/_step_logs.py):
what they print equals engine.comm_summary() and engine.memory_summary()
at each step, prof_ops filters, the totals sum the steps."""
import re

import pytest
import torch

import zero
import zero.deepspeed as deepspeed
from engine_cases import Net, batches, loss_of, no_launcher

MIB = 2 ** 20


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


def config(stage=2, **blocks):
    return {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW",
                                                               "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage}, **blocks}


def run(cfg, steps=3):
    """Each step's comm_summary and memory_summary, the engine closed."""
    torch.manual_seed(0)
    engine = zero.initialize(Net(), config=zero.Config.from_deepspeed(cfg))
    comms, memory = [], []
    for tokens, targets in batches("cpu", steps):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
        comms.append(engine.comm_summary())
        memory.append(engine.memory_summary())
    return engine, comms, memory


def test_comms_logger_prints_each_step_and_the_totals(capsys):
    engine, comms, _ = run(config(comms_logger={"enabled": True, "verbose": True}))
    printed = capsys.readouterr().out.splitlines()
    steps = [line for line in printed if line.startswith("comms: step")]
    assert len(steps) == 3
    for line, summary in zip(steps, comms):
        for op, figures in summary["ops"].items():
            assert f"{op} {figures['calls']} calls {figures['bytes'] / MIB:.3f} MiB" in line
    deepspeed.comm.log_summary()
    table = capsys.readouterr().out
    assert table.startswith("comms over 3 step(s):")
    for op in comms[0]["ops"]:
        calls = sum(c["ops"][op]["calls"] for c in comms)
        total = sum(c["ops"][op]["bytes"] for c in comms) / MIB
        assert re.search(rf"^{op}\s+{calls}\s+{total:.3f}\s", table, re.M), (op, table)
    stats = deepspeed.comm.log_summary(return_dict=True)  # DeepSpeed 0.19.8's signature
    for op in comms[0]["ops"]:
        assert stats["summary"][op] == {
            "count": sum(c["ops"][op]["calls"] for c in comms),
            "total_bytes": sum(c["ops"][op]["bytes"] for c in comms)}
    assert stats["metadata"]["world_size"] == 1 and stats["straggler_analysis"] is None
    capsys.readouterr()
    engine.close()  # nothing new since the table was printed: not printed again
    assert "comms over" not in capsys.readouterr().out


def test_close_prints_the_totals_the_script_never_printed(capsys):
    engine, _, _ = run(config(comms_logger={"enabled": True}))
    capsys.readouterr()
    engine.close()
    assert capsys.readouterr().out.startswith("comms over 3 step(s):")


def test_prof_ops_keeps_the_named_operations(capsys):
    # stage 3: gathers beside the reductions
    engine, comms, _ = run(config(3, comms_logger={"enabled": True, "verbose": True}), steps=1)
    ops = sorted(comms[0]["ops"])
    assert len(ops) >= 2, ops  # a filter needs something to filter out
    engine.close()
    capsys.readouterr()
    engine, _, _ = run(config(3, comms_logger={"enabled": True, "verbose": True,
                                               "prof_ops": [ops[0]]}), steps=1)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("comms: step"))
    assert ops[0] in line and not any(op in line for op in ops[1:])
    engine.close()


def test_a_quiet_comms_logger_prints_only_the_totals(capsys):
    engine, _, _ = run(config(comms_logger={"enabled": True}), steps=2)
    assert "comms: step" not in capsys.readouterr().out
    engine.close()
    assert "comms over 2 step(s)" in capsys.readouterr().out


def test_memory_breakdown_prints_memory_summary(capsys):
    engine, _, memory = run(config(memory_breakdown=True), steps=2)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("memory: step")]
    assert len(lines) == 2
    for step, (line, m) in enumerate(zip(lines, memory), start=1):
        assert line.startswith(f"memory: step {step}: model states "
                               f"{m['model_states'] / MIB:.2f} MiB (params "
                               f"{m['params'] / MIB:.2f}, grads {m['grads'] / MIB:.2f}, "
                               f"optimizer states {m['optimizer_states'] / MIB:.2f}")
        assert "process resident" in line
    engine.close()


def test_bad_logger_blocks_are_named():
    with pytest.raises(ValueError, match=r"comms_logger: unknown key\(s\) \['verbos'\]"):
        zero.Config.from_deepspeed(config(comms_logger={"enabled": True, "verbos": True}))
    cfg = zero.Config.from_deepspeed(config(comms_logger={"enabled": False, "x": 1},
                                            memory_breakdown=False))
    assert cfg.monitor is None
