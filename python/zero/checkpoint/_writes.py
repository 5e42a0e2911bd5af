"""How a checkpoint reaches the disk: every file through a temporary name,
fsynced, renamed; every save into a directory of its own that replaces
the tag whole, so a crash at any point leaves the last good checkpoint
loadable.

[Note: a save replaces a tag whole] A save into <save_dir>/<tag> writes
every rank's files into .<tag>.zero-save.tmp (the staging directory), the
meta last. Only then does rank 0 publish it: the tag's previous directory
(if any) is renamed to .<tag>.zero-old.tmp, the staging directory is
renamed to <tag>, the directory is fsynced, `latest` is written, and the
previous checkpoint is removed. Before this, a save into the tag that
`latest` named rewrote its files in place, and a crash midway left the
only checkpoint refused (files of two saves). Now, at every point:

- before the first rename, <tag> is the previous checkpoint, untouched;
- between the two renames, <tag> is missing and .<tag>.zero-old.tmp is
  the previous checkpoint, whole: the reader takes it from there
  (resolve_tag), and the next save renames it back;
- after the second, <tag> is the new checkpoint, whole.

Leftovers of a killed save (a staging directory, a replaced one whose tag
is whole again, its temporary `latest`) are put right by the next save,
before it writes (recover_interrupted_saves), unless a live save holds
that tag's lock ([Note: save locks]). A load changes nothing on the disk: an
evaluation job may load from a directory while training saves into it,
and removing that save's staging directory, or renaming a replaced tag
back between its two renames, would fail the live save.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil

import torch

from zero.checkpoint._format import (LATEST_FILE, LOCK_SUFFIX, META_FILE, REPLACED_SUFFIX,
                                     SCRIPT_FILE, STAGING_SUFFIX, replaced_directory,
                                     staging_directory)


def write_file(obj, path, on_write=None):
    """torch.save to a temporary name, flushed to the disk, then renamed: a
    crash (or a power cut) never leaves a half-written file under the real
    name, and `latest` is written only after every file it covers is on
    the disk. on_write(n) hears of each n bytes written (a progress bar)."""
    write_through_temporary(path, lambda f: torch.save(obj, f), on_write=on_write)


class _RecordingFile:
    """A file whose first write error is kept: torch.save reports a failed
    write as a RuntimeError without its errno ("unexpected pos")."""

    def __init__(self, f, on_write=None):
        self.f, self.error, self.on_write = f, None, on_write

    def write(self, data):
        try:
            written = self.f.write(data)
        except OSError as error:
            # a copy without the traceback: torch's C++ writer keeps this
            # file object, which the collector cannot see through, and the
            # traceback's frames held the save's locals (an offloaded
            # engine's mapped states: 12 bytes a parameter of disk kept
            # until the process exited)
            self.error = self.error or OSError(error.errno, error.strerror, error.filename)
            raise
        if self.on_write is not None:
            self.on_write(len(data))
        return written

    def flush(self):
        return self.f.flush()


_WRITE_FAILURES = {
    errno.ENOSPC: "the disk is full; free space and save again",
    errno.EDQUOT: "the disk quota is exceeded; free space and save again",
    errno.EFBIG: "the file size limit (ulimit -f) is reached; raise it and save again",
}


def write_through_temporary(path, fill, tmp=None, on_write=None):
    """fill(file) into `tmp` (default path + ".tmp"), fsynced, renamed to
    path. On any failure the temporary file is removed and an OSError
    names `path`."""
    tmp = tmp or path + ".tmp"
    recording = None
    try:
        with open(tmp, "wb") as f:
            recording = _RecordingFile(f, on_write)
            fill(recording)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        _remove_if_there(tmp)
        if not isinstance(error, (OSError, RuntimeError)):
            raise
        cause = recording.error if recording and recording.error else error
        if recording is not None:  # kept by torch's writer: drop what it holds
            recording.error = recording.on_write = None
        raise _write_error(path, cause) from error
    sync_directory(os.path.dirname(path))


def _write_error(path, cause) -> OSError:
    code = getattr(cause, "errno", None)
    why = _WRITE_FAILURES.get(code, f"the write failed ({type(cause).__name__}: {cause})")
    message = f"cannot write checkpoint file {path!r}: {why}"
    return OSError(code, message) if code is not None else OSError(message)


def _remove_if_there(path):
    try:
        os.remove(path)
    except OSError:  # gone already, or not removable: the write's error is the news
        pass


def sync_directory(path):
    """The rename itself reaches the disk with the directory's fsync."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_tree(path):
    """A directory and what it holds, or a link or file in its place (a tag
    that is a link to another tag); what stays is removed at a later save."""
    if os.path.islink(path) or os.path.isfile(path):
        _remove_if_there(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _lock_path(save_dir, tag) -> str:
    return os.path.join(save_dir, f".{tag}{LOCK_SUFFIX}")


def _latest_temporary(save_dir, tag) -> str:
    return os.path.join(save_dir, f".{LATEST_FILE}.{tag}.tmp")


# zero_to_fp32.py's temporary while a save into <tag> writes it: within
# the 16 bytes the save's other names add to a tag (format.check_tag's
# limit). Named .zero_to_fp32.py.<tag>.tmp before 2026-12-07, 21 bytes: a
# tag of 235-239 bytes saved without its script (ENAMETOOLONG); leftovers
# under that name are still recovered
SCRIPT_PREFIX = ".zero-fp32."
_OLD_SCRIPT_PREFIX = f".{SCRIPT_FILE}."


def script_temporary(save_dir, tag, prefix=SCRIPT_PREFIX) -> str:
    """The temporary name of the zero_to_fp32.py a save into `tag` writes."""
    return os.path.join(save_dir, f"{prefix}{tag}.tmp")


class SaveLock:
    """[Note: save locks] Rank 0 holds an exclusive flock on
    .<tag>.zero-save.lock for a save's whole length. The kernel drops it
    when the process dies (SIGKILL too), so a save whose lock can be taken
    is not running: its leftovers are a killed save's. Another engine
    saving into the same directory (two halves of a mesh, say) keeps its
    lock, and its live save is left alone."""

    def __init__(self, save_dir, tag):
        self.path = _lock_path(save_dir, tag)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise RuntimeError(f"another save into tag {tag!r} of {save_dir!r} is running "
                               "(its lock is held); save under another tag, or wait") \
                from None

    def release(self):
        """After the save's last step (its staging directory gone)."""
        if self.fd is not None:
            _remove_if_there(self.path)
            os.close(self.fd)
            self.fd = None


def _unlocked(save_dir, tag):
    """A SaveLock on `tag` if no live save holds it, else None."""
    try:
        return SaveLock(save_dir, tag)
    except (RuntimeError, OSError):
        return None


def _recover_tag(save_dir, tag) -> bool:
    """Put back what a killed save into `tag` left (its lock held by the
    caller): a previous checkpoint moved aside and never replaced goes back
    under its name; its staging directory, a replaced directory whose tag
    is whole, and its temporary `latest` and zero_to_fp32.py are removed."""
    changed = False
    replaced, final = replaced_directory(save_dir, tag), os.path.join(save_dir, tag)
    if os.path.lexists(replaced):
        if not os.path.lexists(final) and os.path.isfile(os.path.join(replaced, META_FILE)):
            os.rename(replaced, final)  # cut short between publish's two renames
        else:
            _remove_tree(replaced)
        changed = True
    for leftover in (staging_directory(save_dir, tag), _latest_temporary(save_dir, tag),
                     script_temporary(save_dir, tag),
                     script_temporary(save_dir, tag, _OLD_SCRIPT_PREFIX)):
        if os.path.lexists(leftover):
            _remove_tree(leftover)
            changed = True
    return changed


def recover_interrupted_saves(save_dir, own_tag):
    """Put right what killed saves left in save_dir, for `own_tag` (whose
    lock the caller holds) and for every other tag whose lock no live
    save holds ([Note: save locks]). Rank 0's work, before a save writes."""
    try:
        names = os.listdir(save_dir)
    except OSError:  # missing or unreadable: the caller's own checks say why
        return
    tags = {own_tag}
    for name in names:
        for suffix in (STAGING_SUFFIX, REPLACED_SUFFIX):
            if name.startswith(".") and name.endswith(suffix) and len(name) > len(suffix) + 1:
                tags.add(name[1:-len(suffix)])
        # the small files' temporaries
        for prefix in (f".{LATEST_FILE}.", SCRIPT_PREFIX, _OLD_SCRIPT_PREFIX):
            if name.startswith(prefix) and name.endswith(".tmp") and \
                    len(name) > len(prefix) + len(".tmp"):
                tags.add(name[len(prefix):-len(".tmp")])
    changed = False
    for tag in sorted(tags):
        if tag == own_tag:
            changed |= _recover_tag(save_dir, tag)
            continue
        lock = _unlocked(save_dir, tag)
        if lock is not None:
            try:
                changed |= _recover_tag(save_dir, tag)
            finally:
                lock.release()
    if changed:
        sync_directory(save_dir)


def prepare_staging(save_dir, tag) -> SaveLock:
    """Lock `tag` and make its staging directory, empty (rank 0, before any
    rank writes into it). The caller releases the lock once the save is
    over, whether it succeeded or not."""
    final = os.path.join(save_dir, tag)
    if os.path.lexists(final) and not os.path.isdir(final):
        raise FileExistsError(f"cannot save into {final!r}: it exists and is not a directory")
    try:
        os.makedirs(save_dir, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:  # a file on the way
        raise NotADirectoryError(
            f"cannot save into {save_dir!r}: it, or a directory above it, is a file "
            "(save_dir names the checkpoint directory, which holds a directory per "
            "tag)") from error
    lock = SaveLock(save_dir, tag)
    try:
        recover_interrupted_saves(save_dir, tag)
        os.makedirs(staging_directory(save_dir, tag))
    except BaseException:
        lock.release()
        raise
    return lock


def publish(save_dir, tag):
    """The staging directory, whole, becomes <tag>; a previous <tag> waits
    aside until discard_replaced ([Note: a save replaces a tag whole])."""
    final = os.path.join(save_dir, tag)
    if os.path.lexists(final):
        os.rename(final, replaced_directory(save_dir, tag))
    os.rename(staging_directory(save_dir, tag), final)
    sync_directory(save_dir)


def unpublish(save_dir, tag):
    """publish undone, for a save that fails after it (its `latest`): the
    new <tag> goes back to staging, to be discarded with it, and the
    previous <tag>, if there was one, returns; so a failed save leaves the
    directory as it found it."""
    final = os.path.join(save_dir, tag)
    os.rename(final, staging_directory(save_dir, tag))
    replaced = replaced_directory(save_dir, tag)
    if os.path.lexists(replaced):
        os.rename(replaced, final)
    sync_directory(save_dir)


def discard_replaced(save_dir, tag):
    _remove_tree(replaced_directory(save_dir, tag))


def discard_staging(save_dir, tag):
    """After a failed save (a full disk on some rank): its files go."""
    _remove_tree(staging_directory(save_dir, tag))


def write_latest(save_dir, tag):
    # a temporary name of the tag's own: two engines saving other tags into
    # one directory never remove each other's
    write_through_temporary(os.path.join(save_dir, LATEST_FILE),
                            lambda f: f.write(tag.encode("utf-8")),
                            tmp=_latest_temporary(save_dir, tag))
