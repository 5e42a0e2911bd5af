"""The C core's disk I/O engine through its binding (zero._C.Aio,
csrc/module_aio.c) and the offload files' use of it (offload/_aio.py):
transfers on every backend this kernel runs, failures reported as OSError
with errno and offset, arguments refused by name, and the backend switch.
Short transfers, EIO and EINTR are injected in tests/c/test_aio.c; here
the failures are real ones (/dev/full, a directory, a short file)."""
import errno
import mmap
import os
import subprocess
import sys

import pytest
import torch

import zero._C as C
from zero.offload import _aio
from zero.offload._nvme import NvmeFiles

BACKENDS = ["threads"] + (["io_uring"] if C.aio_info()["io_uring"] else [])


@pytest.fixture
def data_file(tmp_path):
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    yield fd
    os.close(fd)


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_and_reads_round_trip(data_file, backend):
    """More requests than the queue holds, of lengths that are not whole
    blocks, written out of order and read back into fresh tensors."""
    aio = C.Aio(queue_depth=3, block_size=8192, backend=backend)
    assert aio.backend == backend
    torch.manual_seed(0)
    pieces = [torch.randn(5000 + 7 * k) for k in range(12)]
    offsets = [sum(p.numel() * 4 for p in pieces[:k]) for k in range(len(pieces))]
    for k in reversed(range(len(pieces))):
        aio.submit_write(data_file, pieces[k], offsets[k])
    assert aio.in_flight == len(pieces)
    aio.wait()
    assert aio.in_flight == 0
    back = [torch.empty_like(p) for p in pieces]
    ids = [aio.submit_read(data_file, b, offset=o) for b, o in zip(back, offsets)]
    for request in ids:
        aio.wait(request)
    for p, b in zip(pieces, back):
        assert torch.equal(p, b)
    # and the file holds them, read by plain Python
    assert os.pread(data_file, 16, offsets[3]) == pieces[3][:4].numpy().tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_disk_is_an_oserror_with_errno_and_offset(backend):
    aio = C.Aio(backend=backend)
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        aio.submit_write(full, torch.ones(1024), 8192)
        with pytest.raises(OSError, match=rf"writing 4096 bytes at byte 8192 of fd {full} "
                                          "failed at byte 8192: No space left") as info:
            aio.wait()
        e = info.value
        assert (e.errno, e.fd, e.offset, e.request_offset, e.nbytes) == \
            (errno.ENOSPC, full, 8192, 8192, 4096)
        # the failure was that request's: the engine serves the next one
        fine = torch.zeros(1024)
        aio.wait(aio.submit_write(os.open(os.devnull, os.O_WRONLY), fine))
    finally:
        os.close(full)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reads_that_fail(tmp_path, data_file, backend):
    aio = C.Aio(backend=backend, block_size=4096)
    os.pwrite(data_file, b"x" * 10000, 0)
    out = torch.empty(4096)  # 16384 bytes: past the end of the file
    aio.submit_read(data_file, out, 0)
    with pytest.raises(OSError, match="the file ends at byte 10000 "
                                      r"\(10000 bytes moved\)") as info:
        aio.wait()
    assert info.value.errno is None and info.value.offset == 10000
    directory = os.open(tmp_path, os.O_RDONLY)
    try:
        aio.submit_read(directory, out, 4096)
        with pytest.raises(OSError) as info:
            aio.wait()
        assert info.value.errno == errno.EISDIR and info.value.offset == 4096
    finally:
        os.close(directory)


def test_a_closed_descriptor_is_refused_at_submit(data_file):
    aio = C.Aio()  # first: an io_uring's descriptor would take the closed number
    closed = os.dup(data_file)
    os.close(closed)
    with pytest.raises(OSError, match=f"submit_read: fd {closed} is not an open file "
                                      "descriptor") as info:
        aio.submit_read(closed, torch.empty(4))
    assert info.value.errno == errno.EBADF


@pytest.mark.parametrize("backend", BACKENDS)
def test_descriptors_without_offsets_are_refused_at_submit(tmp_path, backend):
    """A pipe has no offsets: under io_uring its read waited for data for
    good, and close() (and the interpreter's exit) with it, deaf to Ctrl-C;
    an O_APPEND descriptor wrote at the file's end whatever the offset,
    and reported success (C hunt). Both are refused by name at submit."""
    aio = C.Aio(backend=backend)
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(ValueError, match=f"submit_read: fd {read_end} is a pipe, socket "
                                             "or terminal"):
            aio.submit_read(read_end, torch.empty(1024), offset=4096)
        with pytest.raises(ValueError, match=f"submit_write: fd {write_end} is a pipe"):
            aio.submit_write(write_end, torch.ones(1024))
    finally:
        os.close(read_end)
        os.close(write_end)
    path = tmp_path / "appended"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDWR | os.O_APPEND)
    try:
        with pytest.raises(ValueError, match=f"submit_write: fd {fd} is open with O_APPEND"):
            aio.submit_write(fd, torch.ones(1024), offset=0)
        back = torch.empty(1024)
        aio.wait(aio.submit_read(fd, back, offset=0))  # reading one is fine
        assert back.sum() == 0 and path.stat().st_size == 4096
    finally:
        os.close(fd)
    aio.close()


def test_a_dropped_tensor_is_held_until_its_request_is_waited(data_file):
    aio = C.Aio(backend="threads")
    os.pwrite(data_file, torch.arange(1 << 18, dtype=torch.float32).numpy().tobytes(), 0)
    request = aio.submit_read(data_file, torch.empty(1 << 18))  # no other reference
    aio.wait(request)
    with pytest.raises(ValueError, match=f"request {request} is not in flight"):
        aio.wait(request)


@pytest.mark.parametrize("call, kwargs, error, message", [
    ("Aio", dict(queue_depth=0), ValueError, "queue_depth must be >= 1, got 0"),
    ("Aio", dict(queue_depth=4096), ValueError, "queue_depth must be at most 1024"),
    ("Aio", dict(block_size=1000), ValueError, "block_size must be a multiple of 4096"),
    ("Aio", dict(backend="libaio"), ValueError, "backend must be 'auto', 'threads' or "
                                                "'io_uring', got 'libaio'"),
    ("read", dict(fd=-1), ValueError, "fd must be an int >= 0, got -1"),
    ("read", dict(offset=-8), ValueError, "offset must be an int >= 0, got -8"),
    ("read", dict(tensor=[1.0]), TypeError, "tensor must be a tensor"),
    ("read", dict(tensor=torch.zeros(4, dtype=torch.int64)), TypeError,
     "tensor has an unsupported dtype"),
    ("read", dict(tensor=torch.zeros(4, 4).t()), ValueError, "tensor is not contiguous"),
    ("read", dict(offset=2**63 - 8), ValueError, "is past the largest file offset"),
    ("write", dict(fd="read-only"), ValueError, "submit_write: fd .* is open for reading only"),
    ("wait", dict(request="x"), TypeError, "request must be an int"),
])
def test_arguments_are_checked_by_name(data_file, call, kwargs, error, message):
    if call == "Aio":
        with pytest.raises(error, match=message):
            C.Aio(**kwargs)
        return
    aio = C.Aio(backend="threads")
    if call == "wait":
        with pytest.raises(error, match=message):
            aio.wait(**kwargs)
        return
    args = dict(fd=data_file, tensor=torch.zeros(4), offset=0)
    args.update(kwargs)
    if args["fd"] == "read-only":
        args["fd"] = os.open(os.devnull, os.O_RDONLY)
    submit = aio.submit_read if call == "read" else aio.submit_write
    with pytest.raises(error, match=message):
        submit(**args)
    assert aio.in_flight == 0


def test_a_closed_aio_refuses_requests(data_file):
    aio = C.Aio()
    aio.close()
    with pytest.raises(ValueError, match="this Aio was closed"):
        aio.submit_write(data_file, torch.zeros(4))


def _direct(path):
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        pytest.skip("this filesystem has no O_DIRECT")


@pytest.mark.parametrize("backend", BACKENDS)
def test_o_direct_transfers_must_be_aligned(tmp_path, backend):
    fd = _direct(tmp_path / "direct")
    try:
        aio = C.Aio(backend=backend)
        window = torch.frombuffer(mmap.mmap(-1, 8192), dtype=torch.float32)  # page-aligned
        window.copy_(torch.randn(2048))
        aio.wait(aio.submit_write(fd, window, 4096))
        back = torch.frombuffer(mmap.mmap(-1, 8192), dtype=torch.float32)
        aio.wait(aio.submit_read(fd, back, 4096))
        assert torch.equal(window, back)
        for kwargs, what in [(dict(offset=100), "offset must be a multiple of 4096; got 100"),
                             (dict(tensor=window[1:]), "the tensor's address must be"),
                             (dict(tensor=window[:1000]), "the tensor.s size in bytes must be a multiple "
                                                          "of 4096; got 4000")]:
            args = dict(fd=fd, tensor=window, offset=0)
            args.update(kwargs)
            with pytest.raises(ValueError, match=f"fd {fd} is open with O_DIRECT, so {what}"):
                aio.submit_read(**args)
    finally:
        os.close(fd)


def _step_files(directory, write_through):
    """Three paged steps over two files of 5000 elements (5 chunks of
    1024), each adding the chunk's index; returns the files' values."""
    files = NvmeFiles(str(directory), "aio", 1024, write_through=write_through)
    states = [files.create(name, 5000, fill=0.5) for name in ("a", "b")]
    for _ in range(3):
        files.paged_update(5000, lambda lo, hi, w: [t.add_(lo / 1024 + 1) for t in w.values()])
    values = [s.clone() for s in states]
    files.close()
    return values


@pytest.mark.parametrize("write_through, direct", [(False, False), (True, False),
                                                   (True, True)])
def test_the_backend_switch(tmp_path, write_through, direct):
    """The offload files step through either backend, buffered or with
    O_DIRECT, with the same result, against values worked out by hand."""
    expected = 0.5 + 3 * (torch.arange(5000) // 1024 + 1).float()
    previous = _aio.set_io(backend="threads", queue_depth=2, block_size=4096, direct=direct)
    try:
        assert _aio.io_info()["active"] == "threads"
        assert _aio.engine().backend == "threads"
        assert _aio.direct() is direct
        for backend in BACKENDS:
            _aio.set_io(backend=backend)
            assert _aio.engine().backend == backend
            for values in _step_files(tmp_path, write_through):
                assert torch.equal(values, expected), backend
    finally:
        _aio.set_io(**previous)
    with pytest.raises(ValueError, match="queue_depth must be >= 1"):
        _aio.set_io(queue_depth=0)
    with pytest.raises(ValueError, match="direct must be True or False, got 1"):
        _aio.set_io(direct=1)
    assert _aio.io_info()["queue_depth"] == previous["queue_depth"]


def test_the_environment_forces_the_thread_backend():
    code = ("import zero._C as C; from zero.offload import _aio; "
            "print(C.aio_info()['default'], C.Aio().backend, _aio.io_info()['active'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, ZERO_AIO="threads"), check=True).stdout
    assert out.split() == ["threads"] * 3
    info = C.aio_info()
    assert info["env_var"] == "ZERO_AIO"
    assert info["io_uring"] == (info["io_uring_error"] is None)


def test_write_through_files_have_an_o_direct_descriptor(tmp_path, monkeypatch):
    """...where the filesystem allows it; set_io(direct=True) makes the
    step use it, and only for write_through files."""
    import fcntl
    probe = _direct(tmp_path / "probe")  # skips where O_DIRECT is refused
    os.close(probe)
    files = NvmeFiles(str(tmp_path), "direct", 1024, write_through=True)
    files.create("a", 3000)
    assert fcntl.fcntl(files.io_fds["a"], fcntl.F_GETFL) & os.O_DIRECT
    assert not fcntl.fcntl(files.fds["a"], fcntl.F_GETFL) & os.O_DIRECT
    # the file is reserved to whole pages: the last, partial page moves whole
    assert os.fstat(files.fds["a"]).st_size == 3 * 4096
    used = []
    real = _aio.Transfers.submit
    monkeypatch.setattr(_aio.Transfers, "submit",
                        lambda self, w, name, fd, *rest: used.append(fd) or
                        real(self, w, name, fd, *rest))
    previous = _aio.set_io(direct=True)
    try:
        files.paged_update(3000, lambda lo, hi, w: None)
        assert set(used) == {files.io_fds["a"]}
        _aio.set_io(direct=False)
        used.clear()
        files.paged_update(3000, lambda lo, hi, w: None)
        assert set(used) == {files.fds["a"]}
    finally:
        _aio.set_io(**previous)
    files.close()
    cached = NvmeFiles(str(tmp_path), "cached", 1024)
    cached.create("a", 3000)
    assert cached.io_fds["a"] == cached.fds["a"]
    cached.close()


def test_an_interrupt_cuts_the_wait_short_not_the_transfer():
    """Ctrl-C during a wait raises at once; the request stays in flight,
    its tensor held, until a later wait. (/dev/urandom is a slow source.)"""
    import signal
    import time
    aio = C.Aio(backend="threads", queue_depth=1)
    random = os.open("/dev/urandom", os.O_RDONLY)
    out = torch.zeros(32 << 20)  # 128 MiB: about a second from urandom

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        request = aio.submit_read(random, out)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        start = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            aio.wait(request)
        waited = time.perf_counter() - start
        assert aio.in_flight == 1
        aio.wait(request)
        assert aio.in_flight == 0 and (out[-1024:].view(torch.int32) != 0).any()
        assert waited < 0.5, waited
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.close(random)
