"""python -m zero.checkpoint.from_deepspeed DS_CHECKPOINT_DIR OUT_DIR --trust-pickle

A DeepSpeed ZeRO checkpoint (stage 0-3, any data-parallel world size)
written as a zero checkpoint that engine.load_checkpoint(OUT_DIR) resumes:
weights, optimizer states, step counts, the LR scheduler. The work is
checkpoint/_from_deepspeed.py's convert_deepspeed."""
from __future__ import annotations

import argparse
import sys
import warnings

from zero.checkpoint._from_deepspeed import convert_deepspeed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zero.checkpoint.from_deepspeed",
        description="Convert a DeepSpeed ZeRO checkpoint into a zero checkpoint.")
    parser.add_argument("deepspeed_dir", help="the directory DeepSpeed's save_checkpoint wrote "
                        "(with its 'latest' file), or one tag directory of it")
    parser.add_argument("out_dir", help="where to write the zero checkpoint")
    parser.add_argument("--tag", default=None, help="which DeepSpeed tag (default: latest)")
    parser.add_argument("--out-tag", default=None,
                        help="the zero checkpoint's tag (default: DeepSpeed's)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="read DeepSpeed's files, which are pickles (see --help's end)")
    parser.epilog = ("DeepSpeed's files are pickles, which zero's own checkpoints never are; "
                     "without --trust-pickle the command refuses to read them.")
    args = parser.parse_args(argv)
    if not args.trust_pickle:
        parser.error("--trust-pickle is required. " + _why())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            path = convert_deepspeed(args.deepspeed_dir, args.out_dir, tag=args.tag,
                                     out_tag=args.out_tag, trust_pickle=True)
        except (ValueError, OSError) as error:
            parser.error(str(error))
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    print(f"wrote {path}: load it with engine.load_checkpoint({args.out_dir!r})")
    return 0


def _why() -> str:
    from zero.checkpoint._from_deepspeed import TRUST_PICKLE_WHY
    return TRUST_PICKLE_WHY.replace("Pass trust_pickle=True (--trust-pickle)",
                                    "Pass --trust-pickle")


if __name__ == "__main__":
    sys.exit(main())
