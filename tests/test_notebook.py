"""examples/quickstart.ipynb runs top to bottom in a real Jupyter kernel
(nbclient + ipykernel): one process, no launcher, stage 3, a checkpoint
resumed in a fresh engine and consolidated into plain torch. Its cells
assert what they show (the loss falls, the resumed run repeats the
original exactly, the plain model gives the engine's loss); the resume
and consolidation cells run twice, as re-run cells do."""
import os

import pytest

nbformat = pytest.importorskip("nbformat", reason="requirements-test.txt installs nbformat")
nbclient = pytest.importorskip("nbclient", reason="requirements-test.txt installs nbclient")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def test_quickstart_notebook_runs(monkeypatch):
    # launcher variables here (a half set would make zero.initialize refuse)
    # must not reach the kernel, which runs as a notebook does: alone
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    nb = nbformat.read(os.path.join(EXAMPLES, "quickstart.ipynb"), as_version=4)
    # the resume and the consolidation cells run twice, as a user re-runs a cell
    for marker, name in (("consolidate(checkpoints)", "rerun"), ("make_engine(seed=1)",
                                                                 "resume-rerun")):
        again = next(i for i, c in enumerate(nb.cells) if marker in c.source)
        nb.cells.insert(again + 1, nbformat.from_dict({**nb.cells[again], "id": name}))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": EXAMPLES}})
    client.execute(env=env)  # raises CellExecutionError, with the cell, on any error
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs)
    continued = [line for line in text.splitlines() if line.startswith("continued:")]
    resumed = [line for line in text.splitlines() if line.startswith("resumed:")]
    assert continued and resumed
    assert len(continued) == len(resumed) == 2
    for ours, theirs in zip(continued, resumed):
        assert ours.split(":", 1)[1].strip() == theirs.split(":", 1)[1].strip()
