"""The benchmarks' --json output: the folder is made if missing (docs name
bench/results/, which git ignores, so a fresh clone has none; open() failed
only after the whole benchmark had run)."""
import json
import os


def write_json(path, data):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
