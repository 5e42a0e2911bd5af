"""Damaged or misused checkpoints, in one process: a shard file whose table
of pieces or structure is damaged, a save that runs out of room, the
command line pointed at the checkpoint itself or out of its directory,
files of another model or format; and the offload settings' types. Each
is refused with an error that names the file or the setting, and a load
that is refused leaves the engine as it was."""
import errno
import gc
import os
import shutil
import pathlib
import resource
import weakref

import numpy as np
import pytest
import torch

import zero
from zero.checkpoint import consolidate
from zero.checkpoint._command import main
from zero.config import OffloadOptimizer, check_nvme_path
from engine_cases import no_launcher
from test_checkpoint import make_engine, train, unchanged_after

SHARD = "zero_shard_00000.pt"


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


@pytest.fixture
def saved(tmp_path):
    """A stage-2 AdamW checkpoint of one process, in tmp_path/ck/t."""
    engine = make_engine(2)
    train(engine, 0, 2)
    engine.save_checkpoint(tmp_path / "ck", tag="t")
    engine.close()
    return tmp_path / "ck"


@pytest.fixture
def other():
    """An engine with other values to load into."""
    engine = make_engine(2, seed=4)
    yield engine
    engine.close()


def edit(path, change):
    """change(the loaded file's dict) in place, written back."""
    data = torch.load(path, weights_only=True)
    change(data)
    torch.save(data, path)


def set_piece(i, **fields):
    """An edit of groups[0]'s i-th piece; `offset_from` gives the offset as
    a function of (the piece, the group)."""
    def change(shard):
        group = shard["groups"][0]
        name, lo, hi, offset = group["pieces"][i]
        new = {"name": name, "lo": lo, "hi": hi, "offset": offset}
        new.update({k: v for k, v in fields.items() if k != "offset_from"})
        if "offset_from" in fields:
            new["offset"] = fields["offset_from"](group["pieces"], group["tensors"])
        group["pieces"][i] = (new["name"], new["lo"], new["hi"], new["offset"])
    return change


def duplicate_last_piece(shard):
    """A second group holding the same elements of head.bias again."""
    group = shard["groups"][0]
    name, lo, hi, offset = group["pieces"][-1]
    tensors = {k: t[offset:offset + hi - lo].clone() for k, t in group["tensors"].items()}
    shard["groups"].append({"index": 0, "tensors": tensors, "pieces": [(name, lo, hi, 0)]})


def size(tensors):
    return tensors["value"].numel()


PIECE_DAMAGE = {
    # the last piece (head.bias, 50 elements) runs past the tensors' end
    "past_end": (set_piece(-1, offset_from=lambda p, t: size(t) - 2), "runs outside"),
    # ... or starts at their last element: one value would fill all 50
    "at_last_element": (set_piece(-1, offset_from=lambda p, t: size(t) - 1), "runs outside"),
    # moved back onto head.weight's elements
    "onto_another": (set_piece(-1, offset_from=lambda p, t: p[-2][3] + 10),
                     "stored in the same elements"),
    "negative_offset": (set_piece(0, offset=-1), "runs outside"),
    "past_the_parameter": (set_piece(-1, hi=51), "is not a stretch of the parameter's 50"),
    "empty": (set_piece(-1, lo=7, hi=7), "is not a stretch"),
    "float_bound": (set_piece(-1, hi=50.0), "not an integer"),
    "bool_bound": (set_piece(0, lo=False), "not an integer"),
    "unknown_name": (set_piece(-1, name="head.other"), "names no parameter of zero_meta.pt"),
    "not_a_piece": (lambda s: s["groups"][0]["pieces"].append(("head.bias", 0)),
                    r"is not \(name, lo, hi, offset\)"),
    "held_twice": (duplicate_last_piece, r"'head.bias' elements \[0, 50\) overlaps"),
    # structure
    "no_groups": (lambda s: s.pop("groups"), "the shard has no 'groups'"),
    "groups_not_a_list": (lambda s: s.update(groups={"a": 1}), r"\['groups'\] is a dict"),
    "group_not_a_dict": (lambda s: s.update(groups=[5]), "groups\\[0\\] is a int, not a dict"),
    "no_tensors": (lambda s: s["groups"][0].pop("tensors"), "groups\\[0\\] has no 'tensors'"),
    "no_pieces": (lambda s: s["groups"][0].pop("pieces"), "groups\\[0\\] has no 'pieces'"),
    "tensor_2d": (lambda s: s["groups"][0]["tensors"].update(
        exp_avg=s["groups"][0]["tensors"]["exp_avg"].view(-1, 2)), "is not a 1-D tensor"),
    "shard_version": (lambda s: s.update(version=2), f"{SHARD}' has checkpoint version 2"),
    "shard_format": (lambda s: s.update(format="other"), f"{SHARD}' is not a zero checkpoint"),
    "shard_not_a_dict": (lambda s: s.clear(), f"{SHARD}' is not a zero checkpoint"),
}


@pytest.mark.parametrize("damage", list(PIECE_DAMAGE))
def test_a_damaged_shard_is_refused_by_name_before_anything_changes(saved, other, damage):
    change, match = PIECE_DAMAGE[damage]
    edit(saved / "t" / SHARD, change)
    unchanged_after(other, lambda: other.load_checkpoint(saved, tag="t"), ValueError, match)
    with pytest.raises(ValueError, match=SHARD):
        other.load_checkpoint(saved, tag="t")
    with pytest.raises(ValueError, match=match):
        consolidate(saved, "t")


def test_a_state_missing_from_a_shard_is_a_value_error_naming_it(saved):
    edit(saved / "t" / SHARD, lambda s: s["groups"][0]["tensors"].pop("exp_avg"))
    with pytest.raises(ValueError, match=f"{SHARD}' has no 'exp_avg' for parameter"):
        consolidate(saved, "t")


@pytest.mark.parametrize("change, match", [
    (lambda m: m.update(version="1"), "has checkpoint version '1'; this zero reads version 1"),
    (lambda m: m.pop("params"), "the meta has no 'params'"),
    (lambda m: m["params"]["head.bias"].update(numel=49), r"params\['head.bias'\] has shape"),
    (lambda m: m["groups"][0]["param_names"].append("nothing"), "names a parameter not in"),
    (lambda m: m["state_dict"].append(("x", "buffer", None)), r"state_dict\[\d+\] is"),
    (lambda m: m["shards"].append("../zero_shard_00000.pt"), "'shards' is not a list of file"),
    # consolidate hashed the names: a TypeError, and a traceback from the command line
    (lambda m: m["groups"][0]["states"].append([]), r"\['states'\] is not a list of state names"),
])
def test_a_damaged_meta_is_refused_by_name(saved, other, change, match):
    edit(saved / "t" / "zero_meta.pt", change)
    unchanged_after(other, lambda: other.load_checkpoint(saved, tag="t"), ValueError, match)
    with pytest.raises(ValueError, match=match):
        consolidate(saved, "t")


def test_a_buffer_the_model_lacks_is_refused(tmp_path, other):
    engine = make_engine(2)
    engine.module.register_buffer("extra", torch.randn(3))
    engine.save_checkpoint(tmp_path)
    engine.close()
    unchanged_after(other, lambda: other.load_checkpoint(tmp_path), ValueError,
                    "the checkpoint's buffer 'extra' is not in the model")


# ---- save ---------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [5000, 30000])  # in the zip header; in the tensor data
def test_a_save_out_of_room_names_the_file_and_leaves_no_temporary(tmp_path, limit):
    """RLIMIT_FSIZE fails the write as a full disk does (Python ignores
    SIGXFSZ), with EFBIG for ENOSPC; torch.save itself reports it as a
    RuntimeError without the errno."""
    engine = make_engine(2, "bf16")
    train(engine, 0, 1)
    engine.save_checkpoint(tmp_path, tag="before")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(OSError, match=f"cannot write checkpoint file '.*{SHARD}': the file "
                                          r"size limit \(ulimit -f\) is reached") as caught:
            engine.save_checkpoint(tmp_path, tag="after")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    engine.close()
    assert caught.value.errno == errno.EFBIG and caught.value.__cause__ is not None
    assert sorted(os.listdir(tmp_path)) == ["before", "latest", "zero_to_fp32.py"]  # no staging directory
    assert (tmp_path / "latest").read_text() == "before"


@pytest.mark.parametrize("stage", [2, 3])
def test_a_failed_save_leaves_no_hold_on_the_offloaded_states(tmp_path, stage):
    """The write's error was kept with its traceback by the file object
    torch's C++ writer holds (out of the collector's sight), and the
    traceback's frames held the save's locals: an offloaded engine's
    mapped state files stayed, 12 bytes a parameter of disk, until the
    process exited, after close() and del too (beyond-RAM hunt). Now the
    states go with the engine."""
    (tmp_path / "nvme").mkdir()
    engine = make_engine(stage, "bf16", offload_optimizer={"device": "nvme",
                                                           "nvme_path": str(tmp_path / "nvme")})
    train(engine, 0, 1)
    held = [weakref.ref(t) for fg in engine.groups for t in (fg.master, *fg.states.values())]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (30000, hard))
    try:
        with pytest.raises(OSError, match="the file size limit"):
            engine.save_checkpoint(tmp_path / "checkpoints")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    engine.close()
    del engine
    gc.collect()
    assert held and all(r() is None for r in held)


# ---- where a checkpoint is read from, and the command line --------------------------


def run_main(capsys, *argv):
    """main's exit code and the last line it printed to stderr."""
    with pytest.raises(SystemExit) as caught:
        main([str(a) for a in argv])
    return caught.value.code, capsys.readouterr().err.strip().splitlines()[-1]


def test_the_command_line_never_writes_into_the_checkpoint(saved, capsys):
    meta = saved / "t" / "zero_meta.pt"
    before = meta.read_bytes()
    for output in (meta, saved / "t" / "model.pt", saved / "t"):
        code, line = run_main(capsys, saved, output, "--tag", "t")
        assert code == 2 and "would overwrite the checkpoint" in line, line
    (saved / "latest").write_text("t")
    code, line = run_main(capsys, saved, saved / "latest")
    assert code == 2 and "would overwrite the checkpoint" in line, line
    assert meta.read_bytes() == before and (saved / "latest").read_text() == "t"
    # nor another checkpoint directory's latest (its loads then failed)
    other_dir = saved.parent / "other_ckpt"
    shutil.copytree(saved, other_dir)
    code, line = run_main(capsys, saved, other_dir / "latest", "--tag", "t")
    assert code == 2 and "would replace the 'latest' of the zero checkpoint" in line, line
    assert (other_dir / "latest").read_text() == "t"
    shutil.rmtree(other_dir)
    assert sorted(os.listdir(saved / "t")) == sorted(["zero_meta.pt", SHARD])
    # nor into another tag's checkpoint (reading tag u, writing over t's meta)
    shutil.copytree(saved / "t", saved / "u")
    for output in (meta, saved / "t" / "model.pt"):
        code, line = run_main(capsys, saved, output, "--tag", "u")
        assert code == 2 and "is inside the zero checkpoint" in line, line
    assert meta.read_bytes() == before and not (saved / "t" / "model.pt").exists()


def test_tags_stay_inside_the_checkpoint_directory(saved, tmp_path, capsys, other):
    outside = tmp_path / "outside"
    os.rename(saved / "t", outside)  # a checkpoint beside save_dir, not in it
    out = tmp_path / "out.pt"
    for tag in ("../outside", str(outside)):
        code, line = run_main(capsys, saved, out, "--tag", tag)
        assert code == 2 and "must be a plain directory name" in line, line
    (saved / "latest").write_text("../outside")
    code, line = run_main(capsys, saved, out)
    assert code == 2 and "latest' does not name a tag directory inside" in line, line
    unchanged_after(other, lambda: other.load_checkpoint(saved), ValueError,
                    "latest' does not name a tag directory inside")
    assert not out.exists()


def test_command_line_errors_are_one_line_and_exit_2(saved, tmp_path, capsys):
    code, line = run_main(capsys, saved, tmp_path / "missing" / "out.pt", "--tag", "t")
    assert code == 2 and "cannot write output" in line and "missing" in line, line
    code, line = run_main(capsys, tmp_path / "nothing", tmp_path / "out.pt")
    assert code == 2 and "does not exist" in line, line
    code, line = run_main(capsys, saved, tmp_path / "out.pt", "--tag", "t2")
    assert code == 2 and "holds no zero checkpoint" in line, line
    # the tag directory given as the checkpoint directory
    code, line = run_main(capsys, saved / "t", tmp_path / "out.pt")
    assert code == 2 and "is itself a checkpoint's tag directory" in line, line
    assert "--tag" in line and "tag=" in line and repr(str(saved)) in line, line
    edit(saved / "t" / SHARD, lambda s: s.pop("groups"))
    code, line = run_main(capsys, saved, tmp_path / "out.pt", "--tag", "t")
    assert code == 2 and f"{SHARD}' is damaged" in line, line
    assert not (tmp_path / "out.pt").exists()


# ---- offload settings -----------------------------------------------------------------


@pytest.mark.parametrize("path", [b"/tmp", 5])
def test_nvme_path_must_be_a_str_or_a_path(path):
    match = f"offload_optimizer.nvme_path must be a str or an os.PathLike path, got " \
            f"{type(path).__name__}"
    with pytest.raises(TypeError, match=match):
        OffloadOptimizer(device="nvme", nvme_path=path)
    with pytest.raises(TypeError, match=match):
        check_nvme_path(path)


def test_nvme_path_may_be_a_pathlib_path(tmp_path):
    offload = OffloadOptimizer(device="nvme", nvme_path=pathlib.Path(tmp_path))
    assert offload.nvme_path == str(tmp_path)
    check_nvme_path(pathlib.Path(tmp_path))


def test_chunk_elements_takes_any_integer():
    offload = OffloadOptimizer(device="cpu", chunk_elements=np.int64(2048))
    assert offload.chunk_elements == 2048 and type(offload.chunk_elements) is int
    for bad in (True, 2048.0, np.float64(2048), 0):
        with pytest.raises(ValueError, match="chunk_elements must be a positive integer"):
            OffloadOptimizer(device="cpu", chunk_elements=bad)


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_deepspeed_offload_blocks_must_be_objects(key):
    with pytest.raises(ValueError, match=f"zero_optimization.{key} must be an object"):
        zero.Config.from_deepspeed({"zero_optimization": {"stage": 2, key: "cpu"}})


def flip_a_data_byte(path, record_suffix, xor=0x40):
    """One bit of the middle of the record whose name ends in
    `record_suffix`, changed in place, as a bad disk or copy would."""
    import zipfile
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(record_suffix))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = np.frombuffer(f.read(4), dtype="<u2")
        at = info.header_offset + 30 + int(name_len) + int(extra_len) + info.file_size // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ xor]))


def test_a_changed_byte_in_a_shards_data_is_refused_before_anything_changes(saved, other):
    """torch.save records a CRC-32 per record that torch.load never checks:
    before, this loaded a parameter off by a few ulps to ~50, silently."""
    flip_a_data_byte(saved / "t" / SHARD, "data/0")
    match = rf"{SHARD}' is damaged: its record '.*data/0' does not match the CRC-32"
    unchanged_after(other, lambda: other.load_checkpoint(saved, tag="t"), ValueError, match)
    with pytest.raises(ValueError, match=match):
        consolidate(saved, "t")


def test_a_changed_byte_in_a_buffer_of_the_meta_is_refused(tmp_path):
    """The meta holds the buffers: a changed byte there loaded inf."""
    def with_buffer(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 4)
        model.register_buffer("scale", torch.randn(1000))
        return zero.initialize(model, stage=1)
    engine = with_buffer(0)
    engine.save_checkpoint(tmp_path, tag="t")
    engine.close()
    flip_a_data_byte(tmp_path / "t" / "zero_meta.pt", "data/0")
    other = with_buffer(1)
    unchanged_after(other, lambda: other.load_checkpoint(tmp_path, tag="t"), ValueError,
                    r"zero_meta.pt' is damaged: its record '.*data/0' does not match")
    other.close()


def _buffer_engine(seed):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 4)
    model.register_buffer("scale", torch.randn(1000))
    return zero.initialize(model, stage=1)


def test_a_record_marked_a_directory_is_refused(tmp_path):
    """One bit of the meta's central directory (a record's DOS directory
    attribute): zipfile, which checks the CRC, ignores it, and torch.load
    read the record as a directory, never filling the buffer: zeros, or
    freed memory through consolidate, loaded silently."""
    import struct
    import zipfile
    engine = _buffer_engine(0)
    engine.save_checkpoint(tmp_path, tag="t")
    engine.close()
    meta = tmp_path / "t" / "zero_meta.pt"
    with zipfile.ZipFile(meta) as archive:
        name = next(i.filename for i in archive.infolist() if i.filename.endswith("data/0"))
    data = bytearray(meta.read_bytes())
    at = data.find(b"PK\x01\x02")  # the central directory's entries
    while data[at + 46:at + 46 + struct.unpack("<H", data[at + 28:at + 30])[0]] != \
            name.encode():
        at = data.find(b"PK\x01\x02", at + 4)
    data[at + 38] ^= 0x10  # the external attributes' low byte
    meta.write_bytes(bytes(data))
    other = _buffer_engine(1)
    match = r"zero_meta.pt' is damaged: its record '.*data/0'"
    unchanged_after(other, lambda: other.load_checkpoint(tmp_path, tag="t"), ValueError, match)
    other.close()
    with pytest.raises(ValueError, match=match):
        consolidate(tmp_path, "t")


def test_a_damaged_end_record_is_named(saved, other, tmp_path, capsys):
    """zipfile.is_zipfile raises, rather than answering, when the zip64
    end locator names another disk: a bare BadZipFile naming no file, and a
    traceback from the command line."""
    meta = saved / "t" / "zero_meta.pt"
    data = bytearray(meta.read_bytes())
    at = data.rfind(b"PK\x06\x07")  # the zip64 end of central directory locator
    data[at + 4] ^= 0x01  # the disk that holds the zip64 end record: 0 -> 1
    meta.write_bytes(bytes(data))
    match = r"zero_meta.pt' cannot be read, so it is truncated or damaged"
    unchanged_after(other, lambda: other.load_checkpoint(saved, tag="t"), ValueError, match)
    with pytest.raises(ValueError, match=match):
        consolidate(saved, "t")
    code, line = run_main(capsys, saved, tmp_path / "out.pt", "--tag", "t")
    assert code == 2 and "cannot be read" in line, (code, line)


@pytest.mark.parametrize("same_tag", [True, False])
def test_a_save_that_fails_at_latest_leaves_the_directory_as_it_was(tmp_path, monkeypatch,
                                                                    same_tag):
    """A full disk when `latest` is written, the last write of a save: the
    save raised, yet the tag already held the new checkpoint (the previous
    one waited aside, for the next save to delete), against the docs."""
    import zero.checkpoint._engine_save as engine_save
    engine = make_engine(2)
    train(engine, 0, 1)
    engine.save_checkpoint(tmp_path, tag="good")
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    train(engine, 1, 1)

    def full_disk(save_dir, tag):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(engine_save, "write_latest", full_disk)
    with pytest.raises(OSError, match="No space left"):
        engine.save_checkpoint(tmp_path, tag="good" if same_tag else "new")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["good", "latest", "zero_to_fp32.py"]
    assert (tmp_path / "latest").read_text() == "good"
    engine.load_checkpoint(tmp_path)
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    engine.close()


def test_a_save_that_fails_after_latest_names_it_keeps_the_new_tag(tmp_path, monkeypatch):
    """A failure after `latest`'s rename (its directory's sync, an EIO on
    NFS): `latest` names the new tag already, so the tag stays whole
    (putting the old one back left `latest` naming nothing)."""
    import zero.checkpoint._engine_save as engine_save
    engine = make_engine(2)
    train(engine, 0, 1)
    engine.save_checkpoint(tmp_path, tag="t")
    train(engine, 1, 1)
    expected = {k: v.clone() for k, v in engine.full_state_dict().items()}
    real = engine_save.write_latest

    def sync_fails(save_dir, tag):
        real(save_dir, tag)
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(engine_save, "write_latest", sync_fails)
    with pytest.raises(OSError, match="Input/output error"):
        engine.save_checkpoint(tmp_path, tag="u")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["latest", "t", "u", "zero_to_fp32.py"]
    assert (tmp_path / "latest").read_text() == "u"
    train(engine, 2, 1)
    engine.load_checkpoint(tmp_path)
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in expected.items())
    engine.close()


def test_a_script_that_cannot_be_written_leaves_a_complete_checkpoint(tmp_path, monkeypatch):
    """The zero_to_fp32.py a save leaves beside the tags comes after the
    checkpoint is complete: a failed write of it (a full disk) warns and
    keeps the checkpoint, which loads."""
    import zero.checkpoint._recovery_script as recovery_script
    engine = make_engine(2)
    train(engine, 0, 1)
    expected = {k: v.clone() for k, v in engine.full_state_dict().items()}

    def full_disk(path, fill, tmp=None, on_write=None):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(recovery_script, "write_through_temporary", full_disk)
    with pytest.warns(RuntimeWarning, match=r"the checkpoint 't' is saved, but zero_to_fp32.py "
                                            r"could not be written beside it .*No space left"):
        engine.save_checkpoint(tmp_path, tag="t")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["latest", "t"]
    train(engine, 1, 1)
    engine.load_checkpoint(tmp_path)
    after = engine.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in expected.items())
    engine.close()


def test_the_longest_tag_saves_with_its_script_and_leftovers_are_recovered(tmp_path):
    """A tag of the longest length a save allows (239 bytes) saved without
    zero_to_fp32.py: its temporary added 21 bytes to the tag, over the
    file system's 255 (a RuntimeWarning and no script; docs hunt). Now 15.
    A killed save's script temporaries, under today's name and the name
    before, are removed by the next save."""
    import warnings
    engine = make_engine(2)
    train(engine, 0, 1)
    tag = "t" * 239
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the script's failed write warned
        engine.save_checkpoint(tmp_path, tag=tag)
    assert sorted(os.listdir(tmp_path)) == ["latest", tag, "zero_to_fp32.py"]
    for leftover in (f".zero-fp32.{tag}.tmp", ".zero_to_fp32.py.old.tmp"):
        (tmp_path / leftover).write_text("a killed save's")
    engine.save_checkpoint(tmp_path, tag="next")
    assert sorted(os.listdir(tmp_path)) == ["latest", "next", tag, "zero_to_fp32.py"]
    engine.close()


def test_an_hf_checkpoint_folder_points_to_its_zero_checkpoint(tmp_path):
    """ZeroTrainer's checkpoint-N keeps the engine's checkpoint in
    zero_checkpoint/; given the folder itself (a DeepSpeed user's habit,
    whose zero_to_fp32.py takes checkpoint-N), the reader said "pass tag=",
    and -t engine then found nothing (an HF hunt). It names the directory."""
    engine = make_engine(2)
    train(engine, 0, 1)
    folder = tmp_path / "checkpoint-2"
    engine.save_checkpoint(folder / "zero_checkpoint", tag="engine")
    engine.close()
    for tag in (None, "engine"):
        with pytest.raises(FileNotFoundError, match=r"'.*checkpoint-2' is an HF Trainer "
                           r"checkpoint folder: its zero checkpoint is in "
                           r"'.*checkpoint-2/zero_checkpoint'; pass that directory"):
            consolidate(folder, tag)
    assert consolidate(folder / "zero_checkpoint")["model"]
