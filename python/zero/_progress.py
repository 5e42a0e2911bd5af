"""Progress bars for long work (a checkpoint's save and load, partitioned
construction, the conversion of a DeepSpeed checkpoint, the beyond-RAM
benchmark): tqdm's, on standard error, where tqdm is installed and
standard error is a terminal; nothing otherwise, so logs and CI output
stay clean. ZERO_PROGRESS=1 shows them without a terminal too (when tqdm
is there), ZERO_PROGRESS=0 never. The caller decides which rank shows one
(rank 0: one bar per job, not one per process)."""
from __future__ import annotations

import os
import sys


class _Off:
    """A bar that shows nothing."""

    def update(self, n=1):
        pass

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def shown() -> bool:
    wanted = os.environ.get("ZERO_PROGRESS", "")
    if wanted == "0":
        return False
    if wanted != "1":
        try:
            if not sys.stderr.isatty():
                return False
        except (AttributeError, ValueError):  # a replaced or closed stderr
            return False
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def bar(desc: str, total=None, unit="B", enabled=True):
    """A tqdm bar (update(n), close(), a context manager), or one that
    shows nothing. unit "B" counts bytes, scaled to kB/MB/GB."""
    if not enabled or not shown():
        return _Off()
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B",
                unit_divisor=1024 if unit == "B" else 1000, file=sys.stderr,
                dynamic_ncols=True, leave=False)
