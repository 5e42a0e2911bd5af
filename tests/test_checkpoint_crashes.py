"""A save killed at every boundary keeps the last good checkpoint
(tests/crash_save_worker.py does the killing; docs/checkpoints.md,
"Writes survive a crash").

Before, a save into the tag that `latest` named rewrote its files in
place: killed after its shard and before its meta, it left the only
checkpoint refused ("belongs to another save than zero_meta.pt"). Now
whatever the boundary, the directory loads as the checkpoint before the
save (A) or the one it wrote (B), a load changes nothing on the disk, and
the next save removes what the kill left (*.tmp)."""
import json
import os
import subprocess
import sys

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_save_worker.py")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def worker_env():
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}


def test_a_save_killed_at_any_boundary_leaves_a_loadable_checkpoint(tmp_path):
    done = subprocess.run([sys.executable, WORKER, "sweep", str(tmp_path / "ck")],
                          env=worker_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [json.loads(line) for line in done.stdout.splitlines()]
    killed = [r for r in runs if r["killed"]]
    # the save has this many boundaries (the last run completes): shard
    # and meta (each: half written, fsync, rename, directory fsync), the
    # staging directory, the two renames that publish it, latest, the
    # removal of the replaced checkpoint
    assert len(killed) >= 15 and not runs[-1]["killed"] and runs[-1]["exit"] == 0
    for run in runs:
        assert run["read"] in ("A", "B"), run
        assert run["loaded"] == [run["read"]], run
        # a load reads only (a live save may be writing beside it); the
        # next save puts right what the kill left, and "t" is still whole
        assert run["leftovers_after_load"] == run["leftovers_after_kill"], run
        assert run["leftovers_after_next_save"] == [], run
        assert run["read_after_next_save"] == run["read"], run
    # both outcomes occur: killed before the publish, and after it
    assert {r["read"] for r in killed} == {"A", "B"}
    assert runs[-1]["read"] == "B"
    # the kill between the two renames (the tag moved aside, the new one
    # not yet in place) is among them: read from where A waits
    assert any(".t.zero-old.tmp" in r["leftovers_after_kill"] and r["read"] == "A"
               for r in killed)


def _engine():
    import torch
    import zero
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return zero.initialize(model, stage=1)


def test_a_live_save_of_another_tag_is_left_alone(tmp_path, monkeypatch):
    """Two engines saving other tags into one directory (two halves of a
    mesh): the save's recovery removes only leftovers no live save holds
    the lock of. Before, it removed every staging directory in sight."""
    from zero.checkpoint._writes import SaveLock
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    engine = _engine()
    live = tmp_path / ".b.zero-save.tmp"
    live.mkdir()
    (live / "zero_shard_00001.pt").write_bytes(b"being written")
    lock = SaveLock(str(tmp_path), "b")  # the other engine's save, running
    engine.save_checkpoint(tmp_path, tag="a")
    assert (live / "zero_shard_00001.pt").exists()
    lock.release()  # that save died: its lock is free, its files are leftovers
    engine.save_checkpoint(tmp_path, tag="a2")
    assert not live.exists()
    assert sorted(os.listdir(tmp_path)) == ["a", "a2", "latest", "zero_to_fp32.py"]
    engine.close()


def test_a_tag_that_is_a_link_can_be_saved_into_again(tmp_path, monkeypatch):
    """`best` a link to a tag: the save replaces the link with a directory,
    and the link is removed (rmtree refused it, and every later save into
    the tag failed)."""
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    engine = _engine()
    engine.save_checkpoint(tmp_path, tag="t")
    os.symlink("t", tmp_path / "best")
    for _ in range(2):
        engine.save_checkpoint(tmp_path, tag="best")
        assert (tmp_path / "best").is_dir() and not (tmp_path / "best").is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["best", "latest", "t", "zero_to_fp32.py"]
    engine.close()


def test_a_killed_first_save_is_no_checkpoint_to_resume(tmp_path, monkeypatch):
    """A first save killed after its meta and before its publish leaves a
    staging directory only: "resume if there is one" starts afresh."""
    import warnings
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    engine = _engine()
    engine.save_checkpoint(tmp_path / "other", tag="t")
    os.rename(tmp_path / "other" / "t", tmp_path / ".t.zero-save.tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert engine.load_checkpoint(tmp_path) == (None, None)
    engine.close()
