"""Readers of single config values shared by zero.Config and the
DeepSpeed config reader: timeouts in seconds, finite numbers, "enabled"
flags as DeepSpeed reads them, and the refusal of an "auto" only
HuggingFace's integration fills in."""
from __future__ import annotations

import datetime
import math
import numbers


def _seconds(value, name):
    """A timeout as float seconds (None stays None): a positive, finite
    number of seconds or a datetime.timedelta, at least the millisecond
    torch counts in and at most what a timedelta holds."""
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or \
            not math.isfinite(seconds) or not 0.001 <= seconds <= _LONGEST_TIMEOUT:
        raise ValueError(
            f"{name} must be a positive, finite number of seconds (from 0.001 to "
            f"{_LONGEST_TIMEOUT:.0f}) or a datetime.timedelta, got {value!r}; for a very long "
            "wait give a large number, such as 86400 for a day")
    return float(seconds)


# about 31 years: gloo's store timed out at once at 1e10 s and a collective
# never returned at 1e11 s (helper review, 2 ranks), and timedelta.max
# overflowed inside torch
_LONGEST_TIMEOUT = 1e9


def _number(value, name):
    """A finite int or float (not a bool), or a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def auto_refused(name: str, instead: str = "give a value") -> ValueError:
    """The error for an "auto" that only HuggingFace's DeepSpeed integration
    can fill in, where the value changes the result."""
    return ValueError(f"{name} is 'auto', which HuggingFace's DeepSpeed integration fills in "
                      f"from TrainingArguments; {instead} (or train with "
                      "zero.integrations.hf.ZeroTrainer, where the Trainer owns it)")


# the strings DeepSpeed's config model (pydantic) reads as a boolean
_TRUE_WORDS = {"true", "t", "yes", "y", "on", "1"}
_FALSE_WORDS = {"false", "f", "no", "n", "off", "0"}


def _enabled(block: dict, name: str) -> bool:
    """A precision block's "enabled" as DeepSpeed reads it: JSON true/false,
    or a word such as "false" (a string is no longer taken as true because
    it is not empty)."""
    value = block.get("enabled", False)
    if value == "auto":
        raise auto_refused(f"{name}.enabled", "set true or false")
    return deepspeed_bool(value, f"{name}.enabled")


def deepspeed_bool(value, name: str) -> bool:
    """A boolean of a DeepSpeed config as DeepSpeed reads it: JSON
    true/false, 0/1, or a word such as "false" (which Python's truth would
    take as true, being a non-empty string)."""
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    if word in _TRUE_WORDS or word in _FALSE_WORDS:
        return word in _TRUE_WORDS
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be true or false, got {value!r}")


def require_bool(value, name: str) -> bool:
    """A flag of a Python call: True or False itself ("no" or 0 taken by
    truth went the other way, or both ways)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _enabled_or_kept(block: dict, name: str) -> bool:
    """A block's "enabled" where it reads as true or false; any other value
    keeps the block, so its keys are read (and refused) as they are."""
    try:
        return _enabled(block, name)
    except ValueError:
        return True
