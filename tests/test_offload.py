"""offload_optimizer device "nvme": the fp32 master and the optimizer
states in files, paged through RAM in chunks during the step.

The update is elementwise and runs the same C code over the same values,
chunk by chunk, so an offloaded run must equal the in-memory run bit for
bit, at every stage, precision and optimizer. What RAM holds is measured
in a fresh process (VmHWM during the steps, after the construction peak
is reset)."""
import ctypes
import errno
import mmap
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import zero
from zero.offload._nvme import SLOTS, whole_pages
from engine_cases import (Net, assert_checkpoint_chain_exact, assert_same_finish, batches,
                          finish, loss_of, make_optimizer, no_launcher, run_peak_script)


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


def run(stage, precision, optimizer, nvme_path=None, chunk=1024, steps=4, write_through=False):
    torch.manual_seed(0)
    model = Net()
    options = {}
    if nvme_path is not None:
        options["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme_path),
                                        "chunk_elements": chunk,
                                        "write_through": write_through}
    engine = zero.initialize(model, optimizer=make_optimizer(optimizer, model.parameters()),
                             stage=stage, precision=precision, gradient_clipping=0.5,
                             **options)
    for tokens, targets in batches("cpu", steps):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    return engine


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("optimizer", ["adamw", "adagrad", "lion", "sgd_nesterov"])
def test_offloaded_run_equals_the_in_memory_run(tmp_path, stage, precision, optimizer):
    """chunk 1024 elements: every group's partition spans several chunks."""
    expected = finish(run(stage, precision, optimizer))
    engine = run(stage, precision, optimizer, nvme_path=tmp_path)
    assert all(fg.offload is not None and len(fg.offload.chunks(fg.part_size)) > 1
               for fg in engine.groups)
    assert os.listdir(tmp_path) == []  # unlinked once mapped: nothing left after a crash
    assert_same_finish(finish(engine), expected)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("write_through", [False, True])
def test_many_chunks_reuse_the_windows_exactly(tmp_path, precision, write_through):
    """16.6K parameters in chunks of 1024: 17 chunks through 3 windows, so
    every window is read into, updated and written back several times."""
    def train(options):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()),
                                 stage=0, precision=precision, **options)
        for step in range(3):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
            engine.backward(engine(x).float().square().mean())
            engine.step()
        return engine
    expected = finish(train({}))
    engine = train({"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path),
                                          "chunk_elements": 1024,
                                          "write_through": write_through}})
    assert len(engine.groups[0].offload.chunks(engine.groups[0].part_size)) == 17
    assert_same_finish(finish(engine), expected)


@pytest.mark.parametrize("stage", [1, 3])
def test_write_through_run_equals_the_in_memory_run(tmp_path, stage):
    expected = finish(run(stage, "bf16", "adamw"))
    assert_same_finish(finish(run(stage, "bf16", "adamw", nvme_path=tmp_path,
                                  write_through=True)), expected)


def cached_fraction(engine):
    """The share of the offload files' pages in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    cached = pages = 0
    for fg in engine.groups:
        for t in [fg.master, *fg.states.values()]:
            n = (t.numel() * 4 + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * n)()
            assert libc.mincore(t.data_ptr(), t.numel() * 4, vec) == 0, ctypes.get_errno()
            cached += sum(v & 1 for v in vec)
            pages += n
    return cached / pages


@pytest.mark.parametrize("write_through", [False, True])
def test_write_through_keeps_the_states_out_of_the_page_cache(tmp_path, write_through):
    """By default the page cache keeps what the step wrote (the next step
    reads memory); write_through leaves it on the disk alone."""
    engine = run(2, "bf16", "adamw", nvme_path=tmp_path, chunk=1024,
                 write_through=write_through)
    fraction = cached_fraction(engine)
    engine.close()
    if write_through:
        assert fraction <= 0.1, fraction
    else:
        assert fraction >= 0.9, fraction


def test_memory_summary_counts_the_files_apart(tmp_path):
    engine = run(2, "bf16", "adamw", nvme_path=tmp_path, chunk=1024)
    summary = engine.memory_summary()
    psi = summary["trainable_params"]
    part = sum(fg.part_size for fg in engine.groups)
    # master, exp_avg, exp_avg_sq: a file each, in whole pages on the disk
    assert summary["offloaded"] == sum(3 * whole_pages(4 * fg.part_size) for fg in engine.groups)
    assert part >= psi
    # in RAM only the step's windows: SLOTS chunks of each of 3 files
    assert summary["optimizer_states"] == sum(
        min(SLOTS, -(-fg.part_size // 1024)) * min(1024, fg.part_size) * 4 * 3
        for fg in engine.groups)
    assert summary["optimizer_states"] < summary["offloaded"]
    assert "12Ψ/N on nvme" in summary["formula"] and "offloaded" in str(summary)
    engine.close()


@pytest.mark.parametrize("inputs", [10, 300, 1000])
def test_memory_summary_and_estimate_count_the_windows_in_whole_pages(tmp_path, inputs):
    """The step's windows are mappings of whole pages: a partition of 132
    elements holds a page per file, and the summary and the estimate said
    132 x 4 bytes (memory hunt: 3,264 B reported, 12,288 B held). Both now
    count what the windows hold, measured from their storages."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(inputs, 10), nn.Tanh(), nn.Linear(10, 2))
    opt = torch.optim.AdamW(model.parameters())
    settings = dict(stage=1, precision="bf16",
                    offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)})
    estimate = zero.estimate_memory(model, 1, optimizer=opt, **settings)
    engine = zero.initialize(model, optimizer=opt, **settings)
    engine.backward(engine(torch.randn(4, inputs)).float().square().mean())
    engine.step()
    held = sum(t.untyped_storage().nbytes() for fg in engine.groups
               for window in fg.offload._windows for t in window.values())
    assert engine.memory_summary()["optimizer_states"] == estimate["optimizer_states"] == held
    engine.close()


def test_checkpoints_move_between_files_and_memory(tmp_path):
    """Offloaded at stage 3 -> in memory at stage 1 -> offloaded at stage 2:
    the weights and the optimizer states (compared in parameter space,
    consolidated) come through unchanged."""
    (tmp_path / "nvme").mkdir()
    assert_checkpoint_chain_exact(
        tmp_path, lambda: run(3, "bf16", "adamw", nvme_path=tmp_path / "nvme"),
        lambda: run(1, "bf16", "adamw", steps=1),
        lambda: run(2, "bf16", "adamw", nvme_path=tmp_path / "nvme", steps=1))


def test_refusals(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="offload_optimizer.device='nvme' needs nvme_path"):
        zero.Config(offload_optimizer={"device": "nvme"})
    # the directory is checked by initialize, before the model is touched,
    # not by the Config (which may be read, or a run sized, elsewhere)
    zero.Config(offload_optimizer={"device": "nvme", "nvme_path": "/no/such/dir"})
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"nvme_path '/no/such/dir' is not a directory"):
        zero.initialize(model, stage=2, precision="bf16",
                        offload_optimizer={"device": "nvme", "nvme_path": "/no/such/dir"})
    assert all(torch.equal(v, before[k]) and v.dtype == torch.float32
               for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="device must be 'none', 'cpu' or 'nvme', got 'gpu'"):
        zero.Config(offload_optimizer={"device": "gpu"})
    with pytest.raises(ValueError, match="zero does not take: zero_optimization.offload_"
                                         "optimizer.bad: not a DeepSpeed key"):
        zero.Config.from_deepspeed({"zero_optimization": {"offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path), "bad": 1}}})
    # a DeepSpeed NVMe config as written for DeepSpeed: its I/O tuning is
    # accepted and ignored (buffer_size too: 1e8 read as a chunk would
    # cost 3.6 GB of windows)
    ds = zero.Config.from_deepspeed({
        "zero_optimization": {"offload_optimizer": {
            "device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True,
            "buffer_size": 1e8, "buffer_count": 4, "pipeline_read": True,
            "pipeline_write": True, "fast_init": False}},
        "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False,
                "overlap_events": True, "thread_count": 1}})
    assert ds.offload_optimizer == zero.config.OffloadOptimizer(device="nvme",
                                                                nvme_path=str(tmp_path))
    assert zero.Config(offload_optimizer=None).offload_optimizer.device == "none"
    with pytest.raises(ValueError, match="offload_optimizer must be a dict or a "
                                         "zero.config.OffloadOptimizer, got 'nvme'"):
        zero.Config(offload_optimizer="nvme")
    with pytest.raises(ValueError, match="offload_optimizer.write_through must be True or "
                                         "False, got 1"):
        zero.Config(offload_optimizer={"write_through": 1})

    def full_disk(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full_disk)
    with pytest.raises(OSError, match=f"nvme_path '{tmp_path}' has no room for"):
        run(2, "bf16", "adamw", nvme_path=tmp_path, steps=0)


def _swap_descriptors(monkeypatch, choose):
    """Send the step's transfers to choose(writing, offset, fd)'s
    descriptor instead: a way to make the C engine's reads and writes
    fail for real (csrc/aio.c; tests/c/test_aio.c injects faults)."""
    from zero.offload._aio import Transfers
    real = Transfers.submit

    def submit(self, writing, name, fd, tensor, offset):
        return real(self, writing, name, choose(writing, offset, fd), tensor, offset)
    monkeypatch.setattr(Transfers, "submit", submit)


@pytest.mark.parametrize("what", ["reading", "writing"])
def test_an_io_error_in_the_step_is_reported(tmp_path, monkeypatch, what):
    engine = run(2, "bf16", "adamw", nvme_path=tmp_path, steps=1)
    # pread of a directory fails with EISDIR, pwrite to /dev/full with ENOSPC
    bad = os.open(tmp_path, os.O_RDONLY) if what == "reading" else \
        os.open("/dev/full", os.O_WRONLY)
    writing = what == "writing"
    _swap_descriptors(monkeypatch, lambda w, offset, fd: bad if w == writing and offset > 0
                      else fd)
    tokens, targets = next(iter(batches("cpu", 1)))
    engine.backward(loss_of(engine(tokens), targets))
    reason = os.strerror(errno.EISDIR if what == "reading" else errno.ENOSPC)
    with pytest.raises(OSError, match=rf"offload_optimizer: {what} '\w+' at byte 4,096 in "
                                      rf"'{tmp_path}' failed \({reason}\); this "
                                      "step is partly applied, load a checkpoint") as info:
        engine.step()
    assert info.value.errno == (errno.EISDIR if what == "reading" else errno.ENOSPC)
    engine.close()
    os.close(bad)


def test_a_short_file_is_reported(tmp_path, monkeypatch):
    engine = run(2, "bf16", "adamw", nvme_path=tmp_path, steps=1)
    empty = os.open(tmp_path / "empty", os.O_RDWR | os.O_CREAT)
    _swap_descriptors(monkeypatch, lambda writing, offset, fd: fd if writing else empty)
    tokens, targets = next(iter(batches("cpu", 1)))
    engine.backward(loss_of(engine(tokens), targets))
    with pytest.raises(OSError, match="reading '.*' at byte 0 .* moved no bytes"):
        engine.step()
    engine.close()
    os.close(empty)


def test_nothing_to_offload_steps_in_memory(tmp_path):
    """fp32 (the master is the parameters) with plain SGD (no state): no
    file at all, and the step runs as without offload."""
    expected = finish(run(2, "fp32", "sgd"))
    engine = run(2, "fp32", "sgd", nvme_path=tmp_path)
    assert all(not fg.offload.maps for fg in engine.groups)
    assert_same_finish(finish(engine), expected)


def test_a_group_of_empty_parameters(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    model.empty = torch.nn.Parameter(torch.zeros(0))
    optimizer = torch.optim.AdamW([{"params": [model.weight, model.bias]},
                                   {"params": [model.empty]}])
    engine = zero.initialize(model, optimizer=optimizer, stage=1, precision="bf16",
                             offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)})
    engine.backward(engine(torch.randn(4, 8)).float().square().mean())
    engine.step()
    assert len(engine.groups[0].offload.maps) == 3
    engine.close()


def test_close_frees_the_windows_and_descriptors(tmp_path):
    engine = run(2, "bf16", "adamw", nvme_path=tmp_path)
    files = [fg.offload for fg in engine.groups]
    fds = [fd for f in files for fd in f.fds.values()]
    assert all(f._windows is not None for f in files)
    engine.close()
    assert all(f._windows is None and f.fds is None for f in files)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    with pytest.raises(RuntimeError, match="this engine was closed"):
        files[0].paged_update(files[0].chunk, lambda lo, hi, windows: None)


def test_an_exception_in_the_update_waits_for_the_io(tmp_path, monkeypatch):
    """The update fails at the second chunk while the third chunk's read is
    still on its way: the step raises only once no transfer is running, and
    the next step gets fresh windows."""
    import zero.step._step_path as step_path
    from zero.offload import _aio
    engine = run(0, "bf16", "adamw", nvme_path=tmp_path, steps=1, chunk=1024)
    files = engine.groups[0].offload
    assert len(files.chunks(engine.groups[0].part_size)) >= 2
    submitted, real_submit = [], _aio.Transfers.submit
    real_update = step_path.run_update

    def submit(self, *args):
        submitted.append(real_submit(self, *args))
        return submitted[-1]
    calls = [0]

    def failing_update(*args):
        calls[0] += 1
        if calls[0] == 2:
            # the next chunk's read is in flight now
            assert any(not writing for fg in engine.groups
                       for _name, writing in fg.offload._io.pending.values())
            raise RuntimeError("update failed")
        return real_update(*args)
    monkeypatch.setattr(_aio.Transfers, "submit", submit)
    monkeypatch.setattr(step_path, "run_update", failing_update)
    windows = files._windows
    tokens, targets = next(iter(batches("cpu", 1)))
    engine.backward(loss_of(engine(tokens), targets))
    with pytest.raises(RuntimeError, match="update failed"):
        engine.step()
    # every request was waited for: the engine holds none of the windows
    assert submitted and files._io.aio.in_flight == 0
    assert not any(fg.offload._io.pending for fg in engine.groups)
    assert files._windows is None and windows is not None
    engine.close()


FORK_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from zero.offload._nvme import NvmeFiles
    nvme = sys.argv[1]
    def add_one(lo, hi, windows):
        for t in windows.values():
            t.add_(1.0)
    def files():
        f = NvmeFiles(nvme, "fork", 1024)
        state = f.create("state", 5000)
        return f, state
    parent, state = files()
    parent.paged_update(5000, add_one)  # the I/O threads exist now
    pid = os.fork()
    if pid == 0:
        try:
            parent.paged_update(5000, add_one)
            os._exit(3)  # stepped the parent's file
        except RuntimeError as e:
            if "forked child cannot step" not in str(e):
                os._exit(4)
        own, own_state = files()  # the child's own files: a new pool, no hang
        own.paged_update(5000, add_one)
        os._exit(0 if torch.equal(own_state, torch.ones(5000)) else 5)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), torch.equal(state, torch.ones(5000)))
""")


def test_a_forked_child_is_refused_the_parents_files_and_can_make_its_own(tmp_path):
    """(A forked child cannot use the parent's engine at all: its process
    group's threads are gone too. What offload adds is checked here: its
    files are shared, not copied, and its thread pool is the parent's.)"""
    done = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "True"], done.stdout


def test_cpu_offload_of_a_cpu_model_changes_nothing():
    """Its states are in host memory already."""
    torch.manual_seed(0)
    model = Net()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=2,
                             offload_optimizer={"device": "cpu"})
    assert all(fg.offload is None for fg in engine.groups)
    engine.close()


PEAK_SCRIPT = """
    nvme = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    options = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme,
                                     "chunk_elements": 1 << 18}} if nvme != "-" else {}
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()),
                             stage=0, precision="bf16", **options)
    engine.backward(engine(x).float().square().mean())
    engine.step()
    gc.collect()
    built = status("VmHWM") - base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the construction peak no longer counts
    for _ in range(2):
        engine.backward(engine(x).float().square().mean())
        engine.step()
    print(built, status("VmHWM") - base, engine.memory_summary()["offloaded"])
"""


ALLOWANCE = 16 * 2**20


def test_offloaded_states_are_not_held_in_ram(tmp_path):
    """4.2M parameters, bf16 AdamW: 50 MB of fp32 master and states. The
    peak resident memory of training steps, above the process before the
    model existed: in memory it holds them all; offloaded, the step's
    windows: SLOTS (3) chunks of 1 MiB for each of the three files, 9 MiB,
    plus the I/O threads' stacks and the file pages in flight (allowed: 16
    MiB in all). Measured on a 2-core machine: the offloaded run's peak is
    38.7-39.0 MiB under the in-memory one's in steps and 35.9-36.2 MiB at
    construction, of 48.0 MiB of states (the allowance was 12 MiB until
    the construction figure, at its edge, failed under load); states held
    whole in RAM would leave no difference."""
    def peak(nvme):
        return run_peak_script(PEAK_SCRIPT, nvme)
    built_in_memory, in_memory, _ = peak("-")
    built_offloaded, offloaded_peak, offloaded = peak(str(tmp_path))
    states = 12 * 4_198_400
    assert offloaded >= states
    assert in_memory >= states  # the states are resident...
    assert in_memory - offloaded_peak >= states - ALLOWANCE, (in_memory, offloaded_peak)
    # ...and construction writes the master and the states straight into
    # their files, never whole in RAM
    assert built_in_memory - built_offloaded >= states - ALLOWANCE, \
        (built_in_memory, built_offloaded)


def test_a_leftover_file_of_a_process_with_this_pid_does_not_stop_initialize(tmp_path):
    """Offload files are created exclusively and unlinked at once; one left
    by a process killed in between, whose pid came back (a restarted
    container), made every later initialize with that pid fail ("cannot
    create a file for 'master'"). The names now carry a random part."""
    for name in ("master", "exp_avg", "exp_avg_sq"):
        (tmp_path / f"zero-{os.getpid()}-r0-g0-{name}.states").write_bytes(b"")
    engine = run(2, "fp32", "adamw", nvme_path=tmp_path, steps=1)
    engine.close()
    assert len(os.listdir(tmp_path)) == 3  # the leftovers, left to their owner
