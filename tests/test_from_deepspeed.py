"""zero.checkpoint.convert_deepspeed and `python -m zero.checkpoint.from_deepspeed`:
DeepSpeed 0.19.8's own checkpoints (tests/data/deepspeed_checkpoints, made
by `python tests/deepspeed_script.py --make-reference` where DeepSpeed is
installed, at step 6 of that script, fp32 at stages 0-3 on 1 and 2 ranks,
bf16 at stages 1 and 3, fp32 with a frozen parameter at stages 2 and 3)
converted and checked against what DeepSpeed itself
said of them (tests/data/deepspeed_losses.json):
- the converted weights' squared norm equals DeepSpeed's zero_to_fp32's of
  the same checkpoint (stages 1-3), or its gathered weights' (stage 0);
  each tensor equals the module weights DeepSpeed saved beside its masters
  (rounded to bf16 for the bf16 runs);
- the script, on zero with its import line changed, loads the converted
  checkpoint (at another ZeRO stage than DeepSpeed's) and trains the two
  steps DeepSpeed trained after its own resume: the losses agree within
  1e-5 (measured 1.3e-8; the second step reads the converted Adam states
  and step count, the WarmupLR schedule's position too: a step count off
  by one moves the second loss by 3e-4 relative, 30 times the bound);
- refusals: no trust flag, a file that names code, missing ranks,
  tensor-parallel files, the output onto the input."""
import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import zero
from zero.checkpoint import consolidate, convert_deepspeed
from zero.checkpoint._deepspeed_files import load_pickle
from zero.config._schedulers import DeepSpeedWarmup
from deepspeed_runs import ROOT, run_script, script_on_zero
from engine_cases import no_launcher

DATA = ROOT / "tests" / "data"
CHECKPOINTS = DATA / "deepspeed_checkpoints"
REFERENCE = json.loads((DATA / "deepspeed_losses.json").read_text())
NAMES = sorted(os.listdir(CHECKPOINTS))


def test_the_stored_checkpoints_are_there():
    assert set(NAMES) == {"world1-stage0", "world2-stage0", "world1-stage2", "world2-stage1",
                          "world2-stage2", "world2-stage3", "bf16-world2-stage1",
                          "bf16-world2-stage3", "frozen-world2-stage2", "frozen-world2-stage3"}


@pytest.mark.parametrize("name", NAMES)
def test_converted_weights_are_deepspeeds(tmp_path, name):
    convert_deepspeed(CHECKPOINTS / name, tmp_path, trust_pickle=True)
    state = consolidate(str(tmp_path))
    model = state["model"]
    expected = REFERENCE[name]["state_norm_squared"] or REFERENCE[name]["weight_norm_squared"]
    got = float(sum(t.double().square().sum() for t in model.values()))
    assert abs(got - expected) <= 1e-6 * expected
    # each tensor against the weights DeepSpeed kept in its module (stages 0-2)
    tag = CHECKPOINTS / name / "global_step6"
    if (tag / "mp_rank_00_model_states.pt").exists():
        module = load_pickle(str(tag / "mp_rank_00_model_states.pt"))["module"]
        for key, t in model.items():
            saved = module[key]
            assert torch.equal(t.to(saved.dtype), saved), key
    optimizer = state["optimizer"]
    trainable = 5 if name.startswith("frozen") else 6  # body.0.bias frozen
    assert [s["step"].item() for s in optimizer["state"].values()] == [6.0] * trainable
    assert sorted(optimizer["state"][0]) == ["exp_avg", "exp_avg_sq", "step"]
    group = optimizer["param_groups"][0]
    assert group["weight_decay"] == 0.01 and tuple(group["betas"]) == (0.9, 0.999)
    # DeepSpeed's WarmupLR after 6 steps: min + (max - min) log(6) / log(10)
    assert abs(group["lr"] - (1e-3 + 9e-3 * 0.778151250383644)) < 1e-12
    meta = torch.load(tmp_path / "global_step6" / "zero_meta.pt", weights_only=True)
    assert meta["engine"]["global_steps"] == 6 and meta["lr_scheduler"] == \
        {"last_batch_iteration": 5}


def resume_on_zero(directory, world, stage, resume, variant=""):
    return run_script(script_on_zero(directory), world, directory, "--stage", stage,
                      "--resume", resume, *([f"--{variant}"] if variant else []))


@pytest.mark.parametrize("name, stage", [("world1-stage0", 3), ("world1-stage2", 0),
                                         ("world2-stage0", 2), ("world2-stage1", 3),
                                         ("world2-stage3", 1), ("frozen-world2-stage2", 3),
                                         ("frozen-world2-stage3", 1)])
def test_zero_resumes_where_deepspeed_resumed(tmp_path, name, stage):
    """(A frozen parameter: DeepSpeed keeps it in frozen_param_shapes, whole
    in the module at stage 2, in each rank's frozen_param_fragments at 3.)"""
    convert_deepspeed(CHECKPOINTS / name, tmp_path / "converted", trust_pickle=True)
    world = int(name.split("world")[1][0])
    variant = name.split("-world")[0] if "-world" in name else ""
    got = resume_on_zero(tmp_path, world, stage, tmp_path / "converted", variant)
    expected = REFERENCE[name]["losses"][6:]
    assert len(got["losses"]) == len(expected) == 2
    for ours, theirs in zip(got["losses"], expected):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (got["losses"], expected)
    assert got["global_steps"] == REFERENCE[name]["global_steps"] + 2


def test_a_bf16_run_resumes_in_bf16(tmp_path):
    """bf16: zero rounds the converted fp32 masters to bf16 as DeepSpeed
    did, and its two steps give DeepSpeed's losses (measured equal, bit for
    bit; the bound is the fp32 tests')."""
    name = "bf16-world2-stage3"
    convert_deepspeed(CHECKPOINTS / name, tmp_path / "converted", trust_pickle=True)
    got = resume_on_zero(tmp_path, 2, 2, tmp_path / "converted", "bf16")
    for ours, theirs in zip(got["losses"], REFERENCE[name]["losses"][6:]):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs)


def test_the_schedule_takes_deepspeeds_state():
    """DeepSpeed's WarmupLR state ({'last_batch_iteration': 5}, after six
    steps) puts zero's schedule where six steps put it."""
    def schedule():
        p = torch.nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([p], lr=1.0)
        return optimizer, DeepSpeedWarmup(optimizer, 1e-3, 1e-2, 10, "log")
    stepped_optimizer, stepped = schedule()
    for _ in range(6):
        stepped_optimizer.step()
        stepped.step()
    _optimizer, loaded = schedule()
    loaded.load_state_dict({"last_batch_iteration": 5})
    assert loaded.last_epoch == stepped.last_epoch and loaded.get_last_lr() == \
        stepped.get_last_lr()
    stepped.step()
    loaded.step()
    assert loaded.get_last_lr() == stepped.get_last_lr()


def copy_of(tmp_path, name="world2-stage2"):
    target = tmp_path / "ds"
    shutil.copytree(CHECKPOINTS / name, target)
    return target


def command(*args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "zero.checkpoint.from_deepspeed", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=120)


def test_the_command_needs_the_trust_flag(tmp_path):
    refused = command(CHECKPOINTS / "world2-stage2", tmp_path / "out")
    assert refused.returncode == 2 and "--trust-pickle is required" in refused.stderr
    assert "pickle" in refused.stderr and not (tmp_path / "out").exists()
    with pytest.raises(PermissionError, match="pickles"):
        convert_deepspeed(CHECKPOINTS / "world2-stage2", tmp_path / "out")
    for consent in ("no", 1, None):  # a consent is True itself, not a truthy value
        with pytest.raises(TypeError, match="trust_pickle must be True or False"):
            convert_deepspeed(CHECKPOINTS / "world2-stage2", tmp_path / "out",
                              trust_pickle=consent)
    assert not (tmp_path / "out").exists()
    done = command(CHECKPOINTS / "world2-stage2", tmp_path / "out", "--trust-pickle")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "latest").read_text() == "global_step6"


class Payload:
    """Pickles as a call of os.system: what a crafted checkpoint would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_file_that_names_code_is_refused_and_nothing_runs(tmp_path):
    ds = copy_of(tmp_path)
    states = ds / "global_step6" / "mp_rank_00_model_states.pt"
    saved = load_pickle(str(states))
    marker = tmp_path / "ran"
    saved["client"] = Payload(marker)
    torch.save(saved, states)
    with pytest.raises(ValueError, match="cannot be read safely.*system"):
        convert_deepspeed(ds, tmp_path / "out", trust_pickle=True)
    assert not marker.exists() and not (tmp_path / "out" / "latest").exists()


def test_client_state_keeps_what_is_plain(tmp_path):
    import argparse
    ds = copy_of(tmp_path)
    states = ds / "global_step6" / "mp_rank_00_model_states.pt"
    saved = load_pickle(str(states))
    saved["epoch"] = 3
    saved["args"] = argparse.Namespace(lr=0.1)  # a class: read as an inert stand-in
    torch.save(saved, states)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_deepspeed(ds, tmp_path / "out", trust_pickle=True)
    assert any("client_state['args']" in str(w.message) and "Namespace" in str(w.message)
               for w in caught)
    meta = torch.load(tmp_path / "out" / "global_step6" / "zero_meta.pt", weights_only=True)
    assert meta["client_state"] == {"epoch": 3}


def test_missing_ranks_and_model_parallel_files_are_named(tmp_path):
    ds = copy_of(tmp_path)
    (ds / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ValueError, match="1 optimizer-states files for a data-parallel "
                       "world of 2"):
        convert_deepspeed(ds, tmp_path / "out", trust_pickle=True)
    (ds / "global_step6" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").rename(
        ds / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(FileNotFoundError, match=r"rank\(s\) \[0\]"):
        convert_deepspeed(ds, tmp_path / "out", trust_pickle=True)
    shutil.copy(ds / "global_step6" / "mp_rank_00_model_states.pt",
                ds / "global_step6" / "mp_rank_01_model_states.pt")
    with pytest.raises(ValueError, match="tensor or pipeline parallelism"):
        convert_deepspeed(ds, tmp_path / "out", trust_pickle=True)


def test_no_checkpoint_and_output_onto_input_are_refused(tmp_path):
    """An output in or onto the DeepSpeed checkpoint is refused before
    anything is read or written: before, one inside its tag directory was
    written there, and one in its directory replaced DeepSpeed's latest."""
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        convert_deepspeed(tmp_path, tmp_path / "out", trust_pickle=True)
    ds = copy_of(tmp_path)
    latest = (ds / "latest").read_text()
    refusals = [(ds, "the DeepSpeed checkpoint's own directory: its 'latest' file"),
                (ds / "global_step6", "is inside the DeepSpeed checkpoint it reads"),
                (ds / "global_step6" / "out", "is inside the DeepSpeed checkpoint it reads"),
                (ds / "latest", "is a file, not a directory")]
    for out, message in refusals:
        with pytest.raises(ValueError, match=message):
            convert_deepspeed(ds, out, out_tag="converted", trust_pickle=True)
    with pytest.raises(ValueError, match="is inside the DeepSpeed checkpoint"):
        convert_deepspeed(ds / "global_step6", ds / "global_step6", trust_pickle=True)
    assert sorted(os.listdir(ds)) == sorted(os.listdir(CHECKPOINTS / "world2-stage2"))
    assert sorted(os.listdir(ds / "global_step6")) == sorted(
        os.listdir(CHECKPOINTS / "world2-stage2" / "global_step6"))
    assert (ds / "latest").read_text() == latest


def test_the_converted_checkpoint_loads_in_one_process(tmp_path, monkeypatch):
    """The whole route in one process, no script: zero's engine at stage 2
    over the same module loads it and holds DeepSpeed's weights."""
    no_launcher(monkeypatch)
    convert_deepspeed(CHECKPOINTS / "world2-stage3", tmp_path, trust_pickle=True)
    torch.manual_seed(1)
    # tests/deepspeed_script.py's Net (that file imports DeepSpeed)
    model = torch.nn.Sequential()
    model.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                     torch.nn.Linear(32, 32), torch.nn.Tanh())
    model.head = torch.nn.Linear(32, 4)
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1.0),
                             stage=2)
    engine.load_checkpoint(str(tmp_path))
    expected = consolidate(str(tmp_path))["model"]
    state = engine.full_state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    assert engine.global_steps == 6
    engine.close()


def test_loading_deepspeeds_directory_names_the_converter(monkeypatch):
    no_launcher(monkeypatch)
    model = torch.nn.Linear(2, 2)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(FileNotFoundError, match="is a DeepSpeed checkpoint.*"
                       "python -m zero.checkpoint.from_deepspeed"):
        engine.load_checkpoint(str(CHECKPOINTS / "world2-stage2"))
    engine.close()


def test_deepspeeds_tag_directory_or_one_without_latest_is_named_not_skipped(
        monkeypatch, tmp_path):
    """Before, both were taken for a directory that holds no checkpoint yet:
    load_checkpoint warned and returned (None, None), and training started
    from scratch; consolidate's "pass tag=" led nowhere. The printed command
    converts them as it stands."""
    no_launcher(monkeypatch)
    without_latest = copy_of(tmp_path)
    os.remove(without_latest / "latest")
    tag_dir = CHECKPOINTS / "world2-stage2" / "global_step6"
    model = torch.nn.Linear(2, 2)
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for source, tag in ((tag_dir, None), (without_latest, None), (tag_dir, "global_step6")):
        for load in (engine.load_checkpoint, consolidate):
            with pytest.raises(FileNotFoundError, match="is a DeepSpeed checkpoint") as caught:
                load(str(source), tag=tag)
    engine.close()
    said = str(caught.value)
    assert "--tag" not in said
    with pytest.raises(FileNotFoundError) as caught:
        consolidate(str(without_latest))
    printed = re.search(r"python -m zero\.checkpoint\.from_deepspeed (.*?), then", str(caught.value))
    args = printed.group(1).replace("OUT_DIR", str(tmp_path / "out")).split()
    assert "--tag" in args
    assert command(*args).returncode == 0
    assert consolidate(str(tmp_path / "out"))["model"]


def test_the_newest_tag_is_advised_by_the_numbers_in_the_names(monkeypatch, tmp_path):
    """global_step9 and global_step10 and no 'latest': the advice named
    global_step9, sorted as text (review)."""
    ds = copy_of(tmp_path)
    os.remove(ds / "latest")
    shutil.copytree(ds / "global_step6", ds / "global_step10")
    os.rename(ds / "global_step6", ds / "global_step9")
    with pytest.raises(FileNotFoundError, match=r"its tags: global_step9, global_step10\).*"
                                                r"--tag global_step10 "):
        consolidate(str(ds))


def test_two_conversions_of_one_checkpoint_are_one_save(tmp_path):
    """Each machine converting its own copy (node-local disks) made save
    ids of their own, and load_checkpoint, which compares the ranks' save
    ids, refused them on every rank."""
    from zero.checkpoint._format import CheckpointReader
    ids = []
    for out in ("a", "b"):
        path = convert_deepspeed(copy_of(tmp_path / out), tmp_path / out / "zero",
                                 trust_pickle=True)
        ids.append(CheckpointReader(path).meta["save_id"])
    other = convert_deepspeed(CHECKPOINTS / "world2-stage3", tmp_path / "c", trust_pickle=True)
    assert ids[0] == ids[1] != CheckpointReader(other).meta["save_id"]
