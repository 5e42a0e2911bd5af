"""zero._C.Aio called from several threads, and after a fork
([Note: Aio and threads] in csrc/module_aio.c): submit and wait run the
engine without the GIL, so other threads call in meanwhile. Each case
crashed or corrupted memory before: two waiters on one request freed its
entry twice; close() during a wait freed the engine and the tensor under
a transfer still running; a forked child's wait never ended."""
import os
import threading

import pytest
import torch

import zero._C as C

MB = 32  # read in 4 KiB blocks one at a time: long enough to overlap a wait


@pytest.fixture
def slow_read(tmp_path):
    """(an Aio that moves one 4 KiB block at a time, a descriptor of a file
    of MB mebibytes whose bytes are known, those bytes)"""
    path = tmp_path / "data"
    data = torch.randn(MB << 18)  # float32: MB mebibytes
    path.write_bytes(data.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    aio = C.Aio(backend="threads", queue_depth=1, block_size=4096)
    yield aio, fd, data
    aio.close()
    os.close(fd)


def _wait_for(aio, request, outcomes):
    """A thread's wait for one request: "waited", or the message that
    another wait took it."""
    try:
        aio.wait(request)
        outcomes.append("waited")
    except ValueError as error:
        outcomes.append(str(error))


def test_two_threads_waiting_for_one_request(slow_read):
    aio, fd, data = slow_read
    for _ in range(3):
        into = torch.empty(MB << 18)
        request = aio.submit_read(fd, into)
        outcomes = []
        threads = [threading.Thread(target=_wait_for, args=(aio, request, outcomes))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # one wait has it; the other is told it is gone, whichever came first
        assert sorted(outcomes)[-1] == "waited", outcomes
        assert "is not in flight on this Aio" in sorted(outcomes)[0], outcomes
        assert torch.equal(into, data) and aio.in_flight == 0


def test_wait_for_everything_beside_a_wait_for_one(slow_read):
    aio, fd, data = slow_read
    into = torch.empty(MB << 18)
    request = aio.submit_read(fd, into)
    outcomes = []
    one = threading.Thread(target=_wait_for, args=(aio, request, outcomes))
    one.start()
    aio.wait()  # a request another thread takes is no error for wait()
    one.join()
    assert outcomes[0] == "waited" or "is not in flight on this Aio" in outcomes[0]
    assert torch.equal(into, data) and aio.in_flight == 0


def test_close_during_another_threads_wait_is_refused(slow_read):
    aio, fd, data = slow_read
    outcome = {}

    def read_all():
        into = torch.empty(MB << 18)  # only the Aio holds it
        aio.wait(aio.submit_read(fd, into))
        outcome["data"] = into
    reader = threading.Thread(target=read_all)
    reader.start()
    while aio.busy == 0 and reader.is_alive():  # until the reader is in its wait
        pass
    # the read takes tens of ms in 4 KiB blocks; this thread holds the GIL
    # from the check to the call, and the reader needs it to leave its wait
    with pytest.raises(RuntimeError, match="while another thread submits to or waits on "
                                           "this Aio"):
        aio.close()
    reader.join()
    assert torch.equal(outcome["data"], data) and aio.busy == 0
    aio.close()  # once the wait returned


def test_a_forked_child_refuses_its_parents_aio(slow_read):
    aio, fd, data = slow_read
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only the Aio's calls, then out
        os.close(read)
        try:
            aio.submit_read(fd, torch.empty(1024))
            message = b"accepted"
        except RuntimeError as error:
            message = str(error).encode()
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            message = repr(error).encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert "made in another process" in message, message
    # the parent's engine is untouched
    into = torch.empty(MB << 18)
    aio.wait(aio.submit_read(fd, into))
    assert torch.equal(into, data)
