"""Progress bars (python/zero/_progress.py): shown for a checkpoint's save
and load, partitioned construction and a DeepSpeed conversion when
ZERO_PROGRESS=1 (or on a terminal) and tqdm is installed; nothing on
standard error otherwise. The save's bar counts the bytes written: their
sum is the shard file's size."""
import os
import pathlib

import pytest
import torch

import zero
from zero._progress import shown
from zero.checkpoint import convert_deepspeed
from zero.checkpoint._writes import write_file
from engine_cases import Net, batches, loss_of, no_launcher

import tqdm  # noqa: F401  (requirements-test.txt: the bars are tested, not skipped)
CHECKPOINTS = pathlib.Path(__file__).resolve().parent / "data" / "deepspeed_checkpoints"


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


def save_and_load(tmp_path):
    torch.manual_seed(0)
    with zero.partitioned_init():
        model = Net()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3)
    for tokens, targets in batches("cpu", 1):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    engine.close()
    convert_deepspeed(CHECKPOINTS / "world2-stage2", tmp_path / "converted", trust_pickle=True)


def test_bars_show_when_asked(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("ZERO_PROGRESS", "1")
    save_and_load(tmp_path)
    err = capfd.readouterr().err
    for desc in ("partitioned construction", "saving checkpoint (rank 0's shard)",
                 "loading checkpoint (rank 0's part)", "reading the DeepSpeed checkpoint"):
        assert desc in err, err[-2000:]


@pytest.mark.parametrize("setting", ["0", None])
def test_no_bars_off_a_terminal_or_when_refused(tmp_path, monkeypatch, capfd, setting):
    if setting is None:
        monkeypatch.delenv("ZERO_PROGRESS", raising=False)
        assert not shown()  # pytest's captured stderr is not a terminal
    else:
        monkeypatch.setenv("ZERO_PROGRESS", setting)
    save_and_load(tmp_path)
    err = capfd.readouterr().err
    assert "checkpoint" not in err and "construction" not in err


def test_the_save_counts_every_byte(tmp_path):
    counted = []
    path = tmp_path / "f.pt"
    write_file({"a": torch.randn(1000), "b": list(range(10))}, str(path),
               on_write=counted.append)
    assert sum(counted) == os.path.getsize(path) > 4000
