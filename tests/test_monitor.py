"""DeepSpeed's monitor blocks on zero's engine ([Note: monitor events] in
engine/_monitor.py): what the csv and tensorboard monitors write is read
back (csv, and tensorboard's own event reader) and compared with the
losses, learning rates and loss scales of the run, at the global-sample
steps DeepSpeed uses."""
import csv
import json

import pytest
import torch

import zero
from engine_cases import Net, batches, loss_of, no_launcher


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


def train(config, steps=3):
    """(the mean loss of each boundary's micro-batches, the learning rate
    after each boundary's step)."""
    torch.manual_seed(0)
    model = Net()
    engine = zero.initialize(model, config=config)
    means, lrs, window = [], [], []
    for tokens, targets in batches("cpu", 2 * steps):
        loss = loss_of(engine(tokens), targets)
        engine.backward(loss)
        window.append(loss.item())
        engine.step()
        if len(window) == 2:
            means.append(sum(window) / len(window))
            lrs.append(engine.get_lr()[0])
            window = []
    engine.close()
    return means, lrs


def ds_config(tmp_path, **blocks):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                         "warmup_max_lr": 1e-3,
                                                         "warmup_num_steps": 4}},
            "zero_optimization": {"stage": 2}, **blocks}


def read_csv(path):
    with open(path) as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(step), float(value)) for step, value in rows[1:]]


def test_csv_monitor_writes_loss_and_lr_at_the_samples_seen(tmp_path):
    config = ds_config(tmp_path, csv_monitor={"enabled": True, "output_path": str(tmp_path),
                                              "job_name": "run"})
    means, lrs = train(config)
    header, losses = read_csv(tmp_path / "run" / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert [s for s, _ in losses] == [8, 16, 24]  # 4 samples x 2 micro-batches a step
    assert [v for _, v in losses] == pytest.approx(means, rel=1e-6)
    _, written = read_csv(tmp_path / "run" / "Train_Samples_lr.csv")
    assert [v for _, v in written] == pytest.approx(lrs, rel=1e-6)
    assert len(set(lrs)) == 3  # warming up: a different rate each step
    assert not (tmp_path / "run" / "Train_Samples_loss_scale.csv").exists()  # fp32


def test_a_scripts_own_events_go_to_the_same_writers(tmp_path):
    """engine.monitor.write_events, DeepSpeed's monitor tutorial's way to
    log a custom metric (an AttributeError before: a DeepSpeed hunt)."""
    config = ds_config(tmp_path, csv_monitor={"enabled": True, "output_path": str(tmp_path),
                                              "job_name": "run"})
    engine = zero.initialize(Net(), config=config)
    assert engine.monitor.enabled
    engine.monitor.write_events([("Train/Samples/my_metric", 0.5, 8),
                                 ("Train/Samples/my_metric", 2, 16)])
    with pytest.raises(TypeError, match=r"write_events takes \(tag, value, step\) tuples"):
        engine.monitor.write_events([("Train/Samples/my_metric", 0.5)])
    engine.close()
    assert read_csv(tmp_path / "run" / "Train_Samples_my_metric.csv") == \
        (["step", "my_metric"], [(8, 0.5), (16, 2.0)])
    engine = zero.initialize(Net(), config=ds_config(tmp_path))
    assert not engine.monitor.enabled
    engine.monitor.write_events([("Train/Samples/my_metric", 1.0, 1)])  # nowhere, as DeepSpeed
    engine.close()


def test_fp16_writes_the_loss_scale(tmp_path):
    config = ds_config(tmp_path, csv_monitor={"enabled": True, "output_path": str(tmp_path),
                                              "job_name": "fp16"},
                       fp16={"enabled": True, "initial_scale_power": 8})
    train(config, steps=2)
    _, scales = read_csv(tmp_path / "fp16" / "Train_Samples_loss_scale.csv")
    assert [v for _, v in scales] == [256.0, 256.0]


def test_skipped_fp16_steps_advance_the_samples_as_deepspeed_counts_them(tmp_path):
    """A scale of 2^32 overflows fp16 at once: the first boundaries' steps
    are skipped. DeepSpeed counts their samples all the same; before, every
    skipped boundary wrote its events at the step before again (0, 0, ...)."""
    config = ds_config(tmp_path, csv_monitor={"enabled": True, "output_path": str(tmp_path),
                                              "job_name": "skips"},
                       fp16={"enabled": True, "initial_scale_power": 32})
    train(config, steps=4)
    _, scales = read_csv(tmp_path / "skips" / "Train_Samples_loss_scale.csv")
    assert [s for s, _ in scales] == [8, 16, 24, 32]
    assert scales[0][1] > scales[-1][1]  # halved at the skipped steps


def test_monitor_files_go_to_the_job_name_without_an_output_path(tmp_path, monkeypatch):
    """DeepSpeed 0.19.8 writes ./<job_name>/ when output_path is not given
    (its default is ""); zero wrote ./csv_monitor_logs/<job_name>/."""
    monkeypatch.chdir(tmp_path)
    train(ds_config(tmp_path, csv_monitor={"enabled": True, "job_name": "plain"}), steps=1)
    assert (tmp_path / "plain" / "Train_Samples_lr.csv").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


def wandb_history(directory):
    """The history records of the offline run in `directory`: its .wandb
    file is LevelDB's log format (32 KiB blocks of records, each with a
    7-byte header: crc, length, type) after a 7-byte file header, each
    record a wandb protobuf Record."""
    import glob
    import struct
    from wandb.proto import wandb_internal_pb2
    path, = glob.glob(str(directory / "wandb" / "offline-run-*" / "run-*.wandb"))
    raw = open(path, "rb").read()
    assert raw[:4] == b":W&B"
    block, pos, pending, history = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pending += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                # wandb's own keys (_step) come as nested keys
                history.append({item.key or "/".join(item.nested_key):
                                json.loads(item.value_json) for item in record.history.item})
    return history


def test_wandb_logs_deepspeeds_events(tmp_path, monkeypatch):
    """An offline wandb run (no network), read back from its own file."""
    pytest.importorskip("wandb")  # installed by requirements-test.txt
    for key, value in (("WANDB_MODE", "offline"), ("WANDB_DIR", str(tmp_path)),
                       ("WANDB_SILENT", "true"), ("WANDB_CONSOLE", "off")):
        monkeypatch.setenv(key, value)
    import wandb
    means, lrs = train(ds_config(tmp_path, wandb={"enabled": True, "project": "zero-test"}))
    # the run's file is written by wandb's service process, which flushes it
    # when it shuts down (measured: read right after finish(), it held no
    # history once in two CI runs)
    wandb.teardown()
    history = wandb_history(tmp_path)
    assert [h["_step"] for h in history] == [8, 16, 24]
    assert [h["Train/Samples/train_loss"] for h in history] == pytest.approx(means, rel=1e-6)
    assert [h["Train/Samples/lr"] for h in history] == pytest.approx(lrs, rel=1e-6)


def test_tensorboard_events_read_back(tmp_path):
    pytest.importorskip("tensorboard")  # installed by requirements-test.txt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    config = ds_config(tmp_path, tensorboard={"enabled": True, "output_path": str(tmp_path),
                                              "job_name": "tb"})
    means, _ = train(config)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"Train/Samples/train_loss", "Train/Samples/lr"} <= set(events.Tags()["scalars"])
    loss = events.Scalars("Train/Samples/train_loss")
    assert [e.step for e in loss] == [8, 16, 24]
    assert [e.value for e in loss] == pytest.approx(means, rel=1e-6)


def test_a_disabled_monitor_writes_nothing_and_bad_blocks_are_named(tmp_path):
    train(ds_config(tmp_path, csv_monitor={"enabled": False, "output_path": str(tmp_path)}),
          steps=1)
    assert not any(tmp_path.iterdir())
    # "enabled" read as for every DeepSpeed block: the word "true" enables
    # it (it was dropped silently before)
    config = ds_config(tmp_path, csv_monitor={"enabled": "true", "output_path": str(tmp_path),
                                              "job_name": "words"})
    train(config, steps=1)
    assert (tmp_path / "words" / "Train_Samples_lr.csv").exists()
    with pytest.raises(ValueError, match=r"csv_monitor: unknown key\(s\) \['outpt_path'\]"):
        zero.Config(monitor={"csv_monitor": {"enabled": True, "outpt_path": "x"}})
    with pytest.raises(ValueError, match="'comet' is not a monitor zero writes"):
        zero.Config(monitor={"comet": {"enabled": True}})


def test_the_flops_profiler_counts_one_step(tmp_path):
    """The FLOPs of the profiled step's forwards and backwards, against
    torch's own counter over the same work on a plain copy: the engine's
    count is the same (its hooks add no matrix products)."""
    from torch.utils.flop_counter import FlopCounterMode
    report = tmp_path / "flops.txt"
    config = ds_config(tmp_path, flops_profiler={"enabled": True, "profile_step": 2,
                                                 "module_depth": -1, "top_modules": 1,
                                                 "detailed": True,
                                                 "output_file": str(report)})
    torch.manual_seed(0)
    model = Net()
    engine = zero.initialize(model, config=config)
    data = batches("cpu", 6)
    for tokens, targets in data:
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    profiler = engine._monitor.profiler
    engine.close()
    torch.manual_seed(0)
    plain = Net()
    with FlopCounterMode(display=False) as counter:
        for tokens, targets in data[2:4]:  # update 2's two micro-batches
            loss_of(plain(tokens), targets).backward()
    assert profiler.done and profiler.report["flops"] == counter.get_total_flops() > 0
    # each module's row too, named as torch names the plain model's (the
    # second micro-batch's rows were named from the engine: "Net" held
    # half of "Net.body"'s count)
    assert profiler.report["modules"] == {
        name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    text = report.read_text()
    assert "zero flops profiler: update 2" in text and "GFLOP/s" in text
    assert "body" in text  # the modules' breakdown


@pytest.mark.parametrize("block, message", [
    ({"tensorboard": {"enabled": True, "output_path": 5}}, "tensorboard.output_path must be a str"),
    ({"csv_monitor": {"enabled": True, "job_name": 3}}, "csv_monitor.job_name must be a string"),
    ({"comms_logger": {"enabled": True, "prof_ops": "reduce"}},
     "comms_logger.prof_ops must be a list"),
    ({"flops_profiler": {"enabled": True, "profile_step": 0}},
     "flops_profiler.profile_step must be an integer >= 1"),
    ({"comms_logger": {"enabled": True, "verbose": "sometimes"}},
     "comms_logger.verbose must be true or false")])
def test_monitor_values_are_checked_by_name(block, message):
    """Before: a path of another type raised from posixpath, prof_ops
    "reduce" logged nothing (the set of its letters), profile_step 0 never
    profiled."""
    with pytest.raises(ValueError, match=message):
        zero.Config.from_deepspeed(block)


def test_a_flag_written_as_a_word_is_read_as_deepspeed_reads_it():
    cfg = zero.Config.from_deepspeed({"flops_profiler": {"enabled": True, "detailed": "false"}})
    assert cfg.monitor["flops_profiler"]["detailed"] is False  # bool("false") was True
