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
