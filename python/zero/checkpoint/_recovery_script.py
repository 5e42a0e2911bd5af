"""The zero_to_fp32.py that save_checkpoint leaves in the save directory,
as DeepSpeed leaves its own there: DeepSpeed users (and HF Trainer runs)
turn a checkpoint into a model by running it, `python
<save_dir>/zero_to_fp32.py <save_dir> <output_dir>`. Ours holds no logic:
it calls zero's reader (zero.deepspeed.utils.zero_to_fp32.main), so it
needs zero installed, and nothing runs it but a person; loading a
checkpoint never reads it."""
from __future__ import annotations

import os
import stat

from zero._warnings import warn_user
from zero.checkpoint._format import SCRIPT_FILE
from zero.checkpoint._writes import script_temporary, write_through_temporary

SCRIPT = '''#!/usr/bin/env python3
"""The fp32 model of a zero checkpoint in this directory, in DeepSpeed's
files: pytorch_model.bin, or model.safetensors with --safe_serialization.
zero's save_checkpoint wrote this file as DeepSpeed writes its own; it
needs the zero package (pip install zeroshard's checkout).

    python zero_to_fp32.py <checkpoint_dir> <output_dir> [-t TAG]
        [--safe_serialization] [--exclude_frozen_parameters]
"""
import sys

from zero.deepspeed.utils.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
'''


def leave_recovery_script(save_dir, tag):
    """Rank 0's, once the save is complete (`latest` written): a failed
    save leaves the directory as it was, and a script that cannot be
    written leaves a complete checkpoint, with a warning. The temporary
    name is the tag's, as for `latest`, so two engines saving into one
    directory never share one."""
    path = os.path.join(save_dir, SCRIPT_FILE)
    try:
        write_through_temporary(path, lambda f: f.write(SCRIPT.encode("utf-8")),
                                tmp=script_temporary(save_dir, tag))
    except OSError as error:
        warn_user(f"zero: the checkpoint {tag!r} is saved, but {SCRIPT_FILE} could not be "
                  f"written beside it ({error}); `python -m zero.checkpoint {save_dir} "
                  "model.pt` writes its fp32 model", RuntimeWarning)
        return
    try:  # executable, as DeepSpeed's; a share that refuses chmod keeps the file
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except OSError:
        pass
