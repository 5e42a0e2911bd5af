"""tests/deepspeed_script.py run on zero, as a user would run it: its
import line changed to `import zero.deepspeed as deepspeed`, on one rank
(plain python) or several (torchrun), in a process group of its own.
Shared by tests/test_deepspeed_api.py and tests/test_from_deepspeed.py."""
import json
import os
import pathlib
import signal
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "deepspeed_script.py"
IMPORT_LINE = "import deepspeed  # the line a user changes: import zero.deepspeed as deepspeed"
LAUNCHER = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
            "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def script_on_zero(directory: pathlib.Path) -> pathlib.Path:
    """The script, its import line changed, written into `directory`."""
    text = SCRIPT.read_text()
    assert text.count(IMPORT_LINE) == 1
    path = directory / "train.py"
    path.write_text(text.replace(IMPORT_LINE, "import zero.deepspeed as deepspeed"))
    return path


def run_script(script, world: int, directory, *args) -> dict:
    """The script's --out result; `args` are its other arguments."""
    out = directory / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")])
    launch = [sys.executable] if world == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={world}"]
    # a session of its own: a hang kills torchrun's workers too, not only
    # torchrun (they would wait on in the background)
    process = subprocess.Popen([*launch, str(script), "--out", str(out), *map(str, args)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        _stdout, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    assert process.returncode == 0, stderr[-3000:]
    return json.loads(out.read_text())
