"""Checkpoints rewritten by hand or by an attacker, with valid CRCs: tensors
of another layout, dtype or stride, storages larger than their records,
sizes that would take all memory, settings out of range, links out of the
checkpoint directory, files that would run code. Each is refused with an
error naming the file or the value, before anything changes: the engine
(its weights, optimizer states, hyperparameters, scheduler, loss scale and
counters), and the command line's output, which is never written.
Before, a sparse shard tensor passed the checks and failed inside copy_()
with the weights half overwritten, a group's `params` key emptied it, and
an LR scheduler state replaced the scheduler's optimizer with None."""
import copy
import math
import os
import pickle
import zipfile

import pytest
import torch

import zero
from zero.checkpoint import consolidate
from test_checkpoint import make_engine, train
# the stage-2 checkpoint in tmp_path/ck/t (its schedule a LambdaLR), and
# one process with no launcher variables
from test_checkpoint_damage import SHARD, _no_launcher, edit, run_main, saved  # noqa: F401

META = "zero_meta.pt"
CODE_REFUSED = "holds objects that would run code when loaded; zero never loads such files"


@pytest.fixture
def other():
    """An engine that has trained a step (its optimizer states and
    schedule moved), to load into."""
    engine = make_engine(2, seed=4)
    train(engine, 0, 1)
    yield engine
    engine.close()


def snapshot(engine):
    """Everything a load may set."""
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} |
              {"params": [id(p) for p in g["params"]]} for g in engine.optimizer.param_groups]
    scheduler = {k: v for k, v in engine.lr_scheduler.state_dict().items()
                 if k != "lr_lambdas"} if engine.lr_scheduler else None
    return {"model": engine.full_state_dict(), "groups": groups,
            "scheduler": copy.deepcopy(scheduler), "optimizer": engine.lr_scheduler.optimizer
            if engine.lr_scheduler else None,
            "states": [{k: t.clone() for k, t in fg.states.items()} for fg in engine.groups],
            "master": [fg.master.clone() for fg in engine.groups],
            "counts": (engine.global_steps, engine.micro_steps, engine.skipped_steps,
                       engine.loss_scale, [fg.step_count for fg in engine.groups])}


def assert_same(before, after):
    assert before.keys() == after.keys()
    for key in before:
        b, a = before[key], after[key]
        if key == "optimizer":
            assert a is b
        elif key in ("model",):
            assert all(torch.equal(b[k], a[k]) for k in b)
        elif key in ("states",):
            assert all(torch.equal(x[k], y[k]) for x, y in zip(b, a) for k in x)
        elif key == "master":
            assert all(torch.equal(x, y) for x, y in zip(b, a))
        else:
            assert repr(b) == repr(a), key


def refused_and_unchanged(engine, load, match):
    """load() raises ValueError matching `match`; nothing changed; the
    engine trains, saves and reloads after it."""
    before = snapshot(engine)
    with pytest.raises(ValueError, match=match) as caught:
        load()
    assert_same(before, snapshot(engine))
    assert "weights_only" not in str(caught.value)
    return caught.value


def still_trains(engine, tmp_path):
    train(engine, 1, 1)
    engine.save_checkpoint(tmp_path / "after", tag="t")
    engine.load_checkpoint(tmp_path / "after", tag="t")
    train(engine, 2, 1)


def command_line_refuses(capsys, saved, tmp_path, match):
    out = tmp_path / "out.pt"
    code, line = run_main(capsys, saved, out, "--tag", "t")
    assert code == 2 and line.startswith("python -m zero.checkpoint: error:"), line
    assert match in line, line
    assert not out.exists()
    return line


# ---- 1. every record checked before the first write ---------------------------


def _strided(t):
    room = torch.zeros(2 * t.numel(), dtype=t.dtype)
    view = room[::2]
    view.copy_(t)
    return view


SHARD_TENSORS = {
    "sparse": (lambda t: t.to_sparse(), "is a torch.sparse_coo tensor"),
    "integer": (lambda t: t.to(torch.int32), "has dtype torch.int32"),
    "complex": (lambda t: t.to(torch.complex64), "has dtype torch.complex64"),
    "strided": (_strided, "which skip or share elements"),
    "expanded": (lambda t: t[:1].expand(t.numel()), "which skip or share elements"),
}


@pytest.mark.parametrize("kind", list(SHARD_TENSORS))
def test_a_shard_tensor_of_another_kind_is_refused_before_anything_changes(
        saved, other, tmp_path, capsys, kind):
    make, match = SHARD_TENSORS[kind]

    def change(shard):
        tensors = shard["groups"][0]["tensors"]
        tensors["exp_avg"] = make(tensors["exp_avg"])
    edit(saved / "t" / SHARD, change)
    refused_and_unchanged(other, lambda: other.load_checkpoint(saved, tag="t"), match)
    with pytest.raises(ValueError, match=match):
        consolidate(saved, "t")
    command_line_refuses(capsys, saved, tmp_path, match)
    still_trains(other, tmp_path)


def with_buffer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    model.register_buffer("scale", torch.randn(6, 5))
    return zero.initialize(model, stage=1)


@pytest.mark.parametrize("make, match", [
    (lambda t: t.to_sparse(), r"buffers\['scale'\] is a torch.sparse_coo tensor"),
    (lambda t: t.to(torch.complex64), "buffer 'scale' has dtype torch.float32 in the model "
                                      "but torch.complex64 in the checkpoint"),
    (lambda t: t.reshape(-1)[:1].expand(6, 5), "which skip or share elements"),
    (lambda t: t.to(torch.int64), "buffer 'scale' has dtype torch.float32 in the model but "
                                  "torch.int64 in the checkpoint"),
], ids=["sparse", "complex", "expanded", "integer"])
def test_a_buffer_of_another_kind_is_refused(tmp_path, make, match):
    engine = with_buffer(0)
    engine.save_checkpoint(tmp_path, tag="t")
    engine.close()
    edit(tmp_path / "t" / META, lambda meta: meta["buffers"].update(
        scale=make(meta["buffers"]["scale"])))
    other = with_buffer(1)
    refused_and_unchanged(other, lambda: other.load_checkpoint(tmp_path, tag="t"), match)
    other.close()
    if "in the model" not in match:  # consolidate has no model to compare with
        with pytest.raises(ValueError, match=match):
            consolidate(tmp_path, "t")


@pytest.mark.parametrize("make", [
    lambda: torch.randn(5, 6).t(),  # dense in another order: torch.save keeps it so
    lambda: torch.polar(torch.ones(4, 3), torch.randn(4, 3)),  # rotary frequencies
    lambda: torch.empty(3, 0),  # empty: strides (1, 1)
    lambda: torch.randn(4).to(torch.float8_e4m3fn),  # an untyped storage in the pickle
    lambda: torch.arange(6).to(torch.uint16),  # the same
], ids=["transposed", "complex", "empty", "float8", "uint16"])
def test_buffers_of_any_kind_a_model_holds_load(tmp_path, make):
    """What the record checks must not refuse: buffers of models as they
    are (the first cut refused a complex buffer, so a model with one saved
    checkpoints that never loaded)."""
    def model_with(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 4)
        model.register_buffer("table", make())
        return model
    model = model_with(0)
    engine = zero.initialize(model, stage=1)
    engine.save_checkpoint(tmp_path, tag="t")
    engine.close()
    other = zero.initialize(model_with(1), stage=1)
    other.load_checkpoint(tmp_path, tag="t")
    other.close()  # both models' buffers in their own dtype again (a float8 one too)
    assert other.module.table.dtype == model.table.dtype == make().dtype
    bits = [t.contiguous().view(torch.uint8) for t in (other.module.table, model.table)]
    assert torch.equal(*bits)
    assert consolidate(tmp_path, "t")["model"]["table"].shape == model.table.shape


def rewrite_record(path, suffix, change):
    """The torch.save archive at path, written again with the record whose
    name ends in `suffix` replaced by change(its bytes), every CRC valid."""
    with zipfile.ZipFile(path) as archive:
        records = [(info.filename, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records:
            archive.writestr(name, change(data) if name.endswith(suffix) else data)


@pytest.mark.parametrize("keep", [0.5, 1.5])
def test_a_storage_of_another_size_than_its_record_is_refused(saved, other, tmp_path,
                                                              capsys, keep):
    """Through torch.load(mmap=True) a record shorter than its storage read
    the bytes after it (the next record, or past the end of the file)."""
    def change(data):
        return data[:int(len(data) * keep)] if keep < 1 else data + data[:len(data) // 2]
    rewrite_record(saved / "t" / SHARD, "data/0", change)
    match = "storage '0' declares .* bytes but its record holds"
    refused_and_unchanged(other, lambda: other.load_checkpoint(saved, tag="t"), match)
    with pytest.raises(ValueError, match=match):
        consolidate(saved, "t")
    command_line_refuses(capsys, saved, tmp_path, "but its record holds")


# ---- 3. no allocation from a declared size before it is checked -------------------


def test_a_huge_declared_parameter_is_refused_before_memory_is_taken(saved, tmp_path, capsys,
                                                                     monkeypatch):
    """A meta declaring a parameter of 2**36 elements: consolidate asked
    for 256 GiB before it found the files hold 50."""
    def huge(meta):
        meta["params"]["head.bias"].update(shape=[2 ** 36], numel=2 ** 36)
    edit(saved / "t" / META, huge)
    real_empty = torch.empty

    def bounded_empty(*size, **kwargs):
        n = math.prod(size[0] if len(size) == 1 and isinstance(size[0], (tuple, list))
                      else size)
        assert n < 2 ** 30, f"torch.empty of {n} elements"
        return real_empty(*size, **kwargs)
    monkeypatch.setattr(torch, "empty", bounded_empty)
    match = r"holds 50 of elements \[0, 68719476736\) of 'head.bias'"
    with pytest.raises(ValueError, match=match):
        consolidate(saved, "t")
    command_line_refuses(capsys, saved, tmp_path, "of 'head.bias'")


# ---- 2. settings from the checkpoint checked as user input ------------------------


def _set_hyper(**values):
    def change(meta):
        meta["groups"][0]["hyper"].update(values)
    return change


SETTINGS = {
    "params emptied": (_set_hyper(params=[]), "sets 'params' among its hyperparameters"),
    "negative lr": (_set_hyper(lr=-1.0), "lr must be a finite number >= 0"),
    "lr a string": (_set_hyper(lr="0.01"), "lr"),
    "beta out of range": (_set_hyper(betas=(1.5, 0.999)), r"beta1 must be in \[0, 1\)"),
    "scheduler's optimizer": (lambda meta: meta["lr_scheduler"].update(optimizer=None),
                              "lr_scheduler state has the key 'optimizer'"),
    "scheduler's lr nan": (lambda meta: meta["lr_scheduler"].update(_last_lr=[math.nan]),
                           "lr must be a finite number >= 0"),
    "scheduler's count a string": (lambda meta: meta["lr_scheduler"].update(last_epoch="3"),
                                   r"lr_scheduler state\['last_epoch'\] is '3', not an "
                                   "integer"),
    # learning rates may be fractions of integers (SGD(lr=1)); counters not
    "scheduler's count a fraction": (lambda meta: meta["lr_scheduler"].update(last_epoch=2.5),
                                     r"lr_scheduler state\['last_epoch'\] is 2.5, not an "
                                     "integer"),
    "scheduler's lrs too few": (lambda meta: meta["lr_scheduler"].update(base_lrs=[]),
                                r"\['base_lrs'\] is not a list of 1"),
    "negative step count": (lambda meta: meta["groups"][0].update(step=-5),
                            "param group 0 step count is -5"),
    "negative micro steps": (lambda meta: meta["engine"].update(micro_steps=-1),
                             "micro_steps is -1"),
    "scheduler's step a number": (lambda meta: meta["lr_scheduler"].update(step=3),
                                  "lr_scheduler state has the key 'step'"),
    # torch's int64 cannot hold it: an OverflowError naming nothing before
    "step count past int64": (lambda meta: meta["groups"][0].update(step=2 ** 63),
                              r"param group 0 step count is 9223372036854775808, not an "
                              r"integer in \[0, 2\^63\)"),
}


def test_a_scheduler_state_of_another_torch_version_loads(saved, other):
    """A plain key this torch's scheduler does not keep (an older torch's
    `verbose`) is taken, as torch takes it."""
    edit(saved / "t" / META, lambda meta: meta["lr_scheduler"].update(verbose=False))
    other.load_checkpoint(saved, tag="t")
    train(other, 1, 1)


def test_a_schedule_from_integer_learning_rates_resumes(tmp_path):
    """SGD(lr=1) gives the scheduler integer lrs ([1]) until its first
    step; the saved ones are fractions (0.25): the same script resuming was
    refused before, as if the checkpoint came from another scheduler."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return zero.initialize(model, optimizer=optimizer, lr_scheduler=scheduler, stage=1)
    engine = build()
    for _ in range(2):
        engine.backward(engine(torch.ones(3, 4)).sum())
        engine.step()
    engine.save_checkpoint(tmp_path, tag="t")
    engine.close()
    resumed = build()
    assert resumed.get_lr() == [1]
    resumed.load_checkpoint(tmp_path, tag="t")
    assert resumed.get_lr() == [0.25]
    resumed.close()


def test_a_loss_scale_fp32_cannot_hold_is_refused(tmp_path):
    engine = make_engine(2, "fp16")
    train(engine, 0, 1)
    engine.save_checkpoint(tmp_path, tag="t")
    engine.close()
    edit(tmp_path / "t" / META, lambda meta: meta["loss_scaler"].update(scale=1e39))
    other = make_engine(2, "fp16", seed=3)
    refused_and_unchanged(other, lambda: other.load_checkpoint(tmp_path, tag="t"),
                          "loss scale is 1e[+]?39, not a number in")
    other.close()


def test_a_tensor_subclass_in_client_state_is_refused_at_save(tmp_path):
    class Tagged(torch.Tensor):
        pass
    engine = make_engine(2)
    with pytest.raises(TypeError, match=r"client_state\['t'\] is a .*Tagged, a tensor "
                                        "subclass"):
        engine.save_checkpoint(tmp_path, tag="t",
                               client_state={"t": torch.ones(2).as_subclass(Tagged)})
    engine.close()


@pytest.mark.parametrize("case", list(SETTINGS))
def test_settings_from_the_checkpoint_are_checked_before_anything_changes(saved, other,
                                                                         tmp_path, case):
    change, match = SETTINGS[case]
    edit(saved / "t" / META, change)
    refused_and_unchanged(other, lambda: other.load_checkpoint(saved, tag="t"), match)
    still_trains(other, tmp_path)


def test_the_scheduler_state_is_not_applied_when_asked_not_to(saved, other):
    edit(saved / "t" / META, lambda meta: meta["lr_scheduler"].update(optimizer=None))
    other.load_checkpoint(saved, tag="t", load_lr_scheduler_states=False)
    assert other.lr_scheduler.optimizer is other.optimizer
    train(other, 1, 1)


@pytest.mark.parametrize("scale, match", [(math.inf, "loss scale is inf"),
                                          (-2.0, "loss scale is -2.0"),
                                          ("big", "loss scale is 'big'")])
def test_a_loss_scale_out_of_range_is_refused(tmp_path, scale, match):
    engine = make_engine(2, "fp16")
    train(engine, 0, 2)
    engine.save_checkpoint(tmp_path, tag="t")
    engine.close()
    edit(tmp_path / "t" / META, lambda meta: meta["loss_scaler"].update(scale=scale))
    other = make_engine(2, "fp16", seed=3)
    refused_and_unchanged(other, lambda: other.load_checkpoint(tmp_path, tag="t"), match)
    other.close()


# ---- 5. read from inside the checkpoint directory only ----------------------------


def test_a_tag_linked_out_of_the_directory_is_refused(saved, other, tmp_path, capsys):
    outside = tmp_path / "elsewhere"
    os.rename(saved / "t", outside)
    os.symlink(outside, saved / "t")
    match = "is a link to a directory outside"
    refused_and_unchanged(other, lambda: other.load_checkpoint(saved, tag="t"), match)
    (saved / "latest").write_text("t")
    refused_and_unchanged(other, lambda: other.load_checkpoint(saved), match)
    with pytest.raises(ValueError, match=match):
        consolidate(saved)
    command_line_refuses(capsys, saved, tmp_path, match)


def test_a_link_inside_the_directory_is_followed(saved, other):
    os.symlink("t", saved / "alias")
    other.load_checkpoint(saved, tag="alias")


def test_a_file_linked_out_of_the_directory_is_refused(saved, other, tmp_path):
    outside = tmp_path / "elsewhere.pt"
    os.rename(saved / "t" / SHARD, outside)
    os.symlink(outside, saved / "t" / SHARD)
    refused_and_unchanged(other, lambda: other.load_checkpoint(saved, tag="t"),
                          f"{SHARD}' is a link to a file outside")


def test_latest_linked_out_of_the_directory_is_refused_unread(saved, other, tmp_path,
                                                              capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("t")  # names a real tag: read, it would load
    os.remove(saved / "latest")
    os.symlink(secret, saved / "latest")
    error = refused_and_unchanged(other, lambda: other.load_checkpoint(saved),
                                  "latest' is a link to a file outside")
    assert "secret" not in str(error).replace(str(tmp_path), "")
    with pytest.raises(ValueError, match="is a link to a file outside"):
        consolidate(saved)


@pytest.mark.parametrize("contents", ["../SECRET-TOKEN-41", "SECRET/TOKEN", "x" * 5000,
                                      b"\xff\xfeSECRET"],
                         ids=["path", "separator", "long", "not utf-8"])
def test_a_latest_that_names_no_tag_is_not_quoted(saved, other, tmp_path, capsys, contents):
    latest = saved / "latest"
    latest.write_bytes(contents if isinstance(contents, bytes) else contents.encode())
    error = refused_and_unchanged(other, lambda: other.load_checkpoint(saved),
                                  "latest' does not name a tag directory inside")
    assert "SECRET" not in str(error) and "xxxx" not in str(error)
    code, line = run_main(capsys, saved, tmp_path / "out.pt")
    assert code == 2 and "SECRET" not in line and "xxxx" not in line


def test_a_latest_that_is_a_fifo_is_refused_without_waiting(saved, other):
    os.remove(saved / "latest")
    os.mkfifo(saved / "latest")  # opened for reading, it would wait for a writer
    refused_and_unchanged(other, lambda: other.load_checkpoint(saved),
                          "latest' is not a regular file")


def test_a_file_not_of_zero_is_not_quoted(saved, other):
    torch.save({"format": "SECRET-FORMAT", "version": "SECRET-VERSION"}, saved / "t" / META)
    error = refused_and_unchanged(other, lambda: other.load_checkpoint(saved, tag="t"),
                                  "is not a zero checkpoint file")
    assert "SECRET" not in str(error)


# ---- 6. a file that would run code is named as such ------------------------------


class Payload:
    """Unpickled, it would create a marker file (os.system)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("how", ["torch.save", "pickle.dump"])
@pytest.mark.parametrize("victim", [META, SHARD])
def test_a_file_that_would_run_code_is_refused_as_such(saved, other, tmp_path, capsys, how,
                                                       victim):
    marker = tmp_path / "ran"
    path = saved / "t" / victim
    payload = {"format": "zeroshard.checkpoint", "version": 1, "groups": [Payload(marker)]}
    if how == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f)
    match = f"{victim}' is refused: it {CODE_REFUSED}"
    refused_and_unchanged(other, lambda: other.load_checkpoint(saved, tag="t"), match)
    with pytest.raises(ValueError, match=match):
        consolidate(saved, "t")
    line = command_line_refuses(capsys, saved, tmp_path, CODE_REFUSED)
    assert "weights_only" not in line and "damaged" not in line
    assert not marker.exists()


@pytest.mark.parametrize("payload", ["code", "plain"])
def test_a_file_in_torchs_legacy_format_is_named_so(saved, other, tmp_path, capsys, payload):
    """torch.save(..., _use_new_zipfile_serialization=False) writes a
    series of pickles; zero reads zip archives only and says that, rather
    than calling the file damaged, whether it holds code or not."""
    marker = tmp_path / "ran"
    path = saved / "t" / META
    content = {"format": "zeroshard.checkpoint", "version": 1,
               "groups": [Payload(marker) if payload == "code" else torch.zeros(3)]}
    torch.save(content, path, _use_new_zipfile_serialization=False)
    match = "is in torch's legacy format"
    refused_and_unchanged(other, lambda: other.load_checkpoint(saved, tag="t"), match)
    with pytest.raises(ValueError, match=match):
        consolidate(saved, "t")
    line = command_line_refuses(capsys, saved, tmp_path, "legacy format")
    assert "damaged" not in line
    assert not marker.exists()


@pytest.mark.parametrize("make, exact", [
    (lambda: torch.tensor([1 + 2j, 3 - 4j]), False),
    (lambda: torch.tensor([2 ** 24 + 1, 123456789]), False),
    (lambda: torch.tensor([3, -7, 2 ** 20]), True),
    (lambda: torch.tensor([1 + 0j, -2 + 0j]), True),
], ids=["complex", "int64 past 2**24", "small int64", "real complex"])
def test_a_frozen_parameter_fp32_cannot_hold_is_refused_at_save(tmp_path, make, exact):
    """Frozen parameters are kept in fp32 in a checkpoint: values it cannot
    hold loaded changed, silently ([1+2j] as [1+0j], 2**24+1 as 2**24).
    They are refused at save now; values it holds round-trip exactly."""
    def model_with(value):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        model.table = torch.nn.Parameter(value, requires_grad=False)
        return model
    model = model_with(make())
    engine = zero.initialize(model, stage=2)
    if not exact:
        with pytest.raises(ValueError, match="frozen parameter 'table' .* holds values fp32 "
                                             "cannot keep exactly"):
            engine.save_checkpoint(tmp_path, tag="t")
        assert not (tmp_path / "t").exists()
        engine.close()
        return
    engine.save_checkpoint(tmp_path, tag="t")
    engine.close()
    other = zero.initialize(model_with(torch.zeros_like(make())), stage=2)
    other.load_checkpoint(tmp_path, tag="t")
    assert torch.equal(other.module.table, make())
    other.close()
