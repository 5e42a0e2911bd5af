"""offload_param at stage 3: "nvme" keeps each group's parameter shard in a
file, read unit by unit through its mapping; "cpu" changes nothing for a
CPU model (its shard is in host memory already).

The gathers and the update read and write the same values through the
mapping, so an offloaded run must equal the in-memory run bit for bit.
What the process holds of the shard is read from /proc/self/smaps (the
mapping's resident bytes) after each kind of use, and the peak of a
training step from VmHWM in a fresh process."""
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import zero
from engine_cases import (Net, assert_checkpoint_chain_exact, assert_same_finish, batches,
                          finish, loss_of, make_optimizer, mapped_rss, no_launcher,
                          run_peak_script)


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    no_launcher(monkeypatch)


def run(precision, optimizer, param_path=None, states_path=None, steps=4, frozen=False,
        **options):
    torch.manual_seed(0)
    model = Net()
    if frozen:
        model.body[0].requires_grad_(False)  # a group of frozen parameters, also in a file
    if param_path is not None:
        options["offload_param"] = {"device": "nvme", "nvme_path": str(param_path)}
    if states_path is not None:
        options["offload_optimizer"] = {"device": "nvme", "nvme_path": str(states_path),
                                        "chunk_elements": 1024}
    params = [p for p in model.parameters() if p.requires_grad]
    engine = zero.initialize(model, optimizer=make_optimizer(optimizer, params), stage=3,
                             precision=precision, gradient_clipping=0.5,
                             gradient_accumulation_steps=2, **options)
    for tokens, targets in batches("cpu", 2 * steps):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    return engine


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("optimizer", ["adamw", "lion", "sgd_nesterov"])
@pytest.mark.parametrize("with_states", [False, True], ids=["params", "params+states"])
def test_offloaded_parameters_equal_the_in_memory_run(tmp_path, precision, optimizer,
                                                      with_states):
    """A frozen group and persistent units (a threshold of 600 elements
    keeps the LayerNorm and the smaller Linear gathered) included."""
    options = dict(frozen=True, stage3_param_persistence_threshold=600)
    expected = finish(run(precision, optimizer, **options))
    engine = run(precision, optimizer, param_path=tmp_path,
                 states_path=tmp_path if with_states else None, **options)
    assert all(fg.param_files is not None for fg in engine.all_groups)
    assert any(u.persistent for fg in engine.all_groups for u in fg.units)
    assert os.listdir(tmp_path) == []  # unlinked once mapped
    assert_same_finish(finish(engine), expected)


def test_a_relative_nvme_path_stays_where_it_was_at_initialize(tmp_path, monkeypatch):
    """close() makes a file beside the shards: after a chdir, a relative
    path pointed it at another directory (or none), and close() failed
    there (offload hunt)."""
    expected = finish(run("fp32", "adamw"))
    (tmp_path / "off").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = Net()
    engine = zero.initialize(model, optimizer=make_optimizer("adamw", model.parameters()),
                             stage=3, gradient_clipping=0.5, gradient_accumulation_steps=2,
                             offload_param={"device": "nvme", "nvme_path": "off"},
                             offload_optimizer={"device": "nvme", "nvme_path": "off"})
    assert engine.config.offload_param.nvme_path == str(tmp_path / "off")
    assert engine.config.offload_optimizer.nvme_path == str(tmp_path / "off")
    monkeypatch.chdir(tmp_path / "elsewhere")  # no "off" here
    for tokens, targets in batches("cpu", 8):
        engine.backward(loss_of(engine(tokens), targets))
        engine.step()
    assert_same_finish(finish(engine), expected)  # close() included
    assert os.listdir(tmp_path / "elsewhere") == []


def shard_rss(engine):
    return sum(mapped_rss(fg.shard) for fg in engine.all_groups)


class Wide(nn.Module):
    """Units of 64K elements (128 KiB in bf16): many pages each."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_the_shard_is_not_kept_mapped(tmp_path):
    """After construction, inside each module's forward and backward (its
    unit gathered), after the step, a checkpoint's save and load,
    full_state_dict and a write through GatheredParameters: none of the
    shard's pages stays in the process."""
    torch.manual_seed(0)
    model = Wide()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             precision="bf16", stage3_param_persistence_threshold=0,
                             offload_param={"device": "nvme", "nvme_path": str(tmp_path)})
    assert engine.memory_summary()["params_offloaded"] >= 4 * 256 * 257 * 2
    seen = {"after construction": shard_rss(engine)}

    def record(where):
        def hook(*_args):
            seen.setdefault(where, shard_rss(engine))  # returns None: output unchanged
        return hook
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(record(f"forward {i}"))
        layer.register_full_backward_hook(record(f"backward {i}"))
    x = torch.randn(8, 256, requires_grad=True)  # every layer has an input gradient
    for _ in range(2):
        engine.backward(engine(x).float().square().mean())
        engine.step()
    seen["after the step"] = shard_rss(engine)
    engine.save_checkpoint(tmp_path / "ckpt")
    seen["after save_checkpoint"] = shard_rss(engine)
    engine.load_checkpoint(tmp_path / "ckpt")
    seen["after load_checkpoint"] = shard_rss(engine)
    engine.full_state_dict()
    seen["after full_state_dict"] = shard_rss(engine)
    with zero.GatheredParameters([model.layers[1].weight], modifier_rank=0):
        with torch.no_grad():
            model.layers[1].weight.mul_(0.5)
    seen["after GatheredParameters"] = shard_rss(engine)
    assert len(seen) == 14
    assert all(rss == 0 for rss in seen.values()), seen
    engine.close()


def test_checkpoints_move_between_files_and_memory(tmp_path):
    """Parameters in a file at stage 3 -> in memory at stage 3 -> in a file
    again: the weights and the states come through unchanged."""
    (tmp_path / "nvme").mkdir()
    assert_checkpoint_chain_exact(
        tmp_path, lambda: run("bf16", "adamw", param_path=tmp_path / "nvme"),
        lambda: run("bf16", "adamw", steps=1),
        lambda: run("bf16", "adamw", param_path=tmp_path / "nvme", steps=1))


def test_close_frees_the_descriptors(tmp_path):
    engine = run("bf16", "adamw", param_path=tmp_path, steps=1)
    fds = [fd for fg in engine.all_groups for fd in fg.param_files.fds.values()]
    assert fds
    engine.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


class WithMarker(nn.Module):
    """A frozen empty parameter (a device marker): a group with no elements,
    which has no file."""

    def __init__(self):
        super().__init__()
        self.marker = nn.Parameter(torch.empty(0), requires_grad=False)
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x)


def test_a_group_without_elements(tmp_path):
    def train(param_path):
        torch.manual_seed(0)
        model = WithMarker()
        options = {"offload_param": {"device": "nvme", "nvme_path": str(param_path)}} \
            if param_path else {}
        engine = zero.initialize(model, optimizer=torch.optim.AdamW([model.lin.weight,
                                                                    model.lin.bias]),
                                 stage=3, stage3_param_persistence_threshold=0, **options)
        for i in range(2):
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i))
            engine.backward(engine(x).square().mean())
            engine.step()
        return finish(engine)
    assert_same_finish(train(tmp_path), train(None))


FORK_SCRIPT = """
import os, sys, torch, zero
for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
    os.environ.pop(var, None)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                         stage3_param_persistence_threshold=0,
                         offload_param={"device": "nvme", "nvme_path": sys.argv[1]})
x = torch.randn(4, 8)
before = engine(x).detach().clone()
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        with zero.GatheredParameters([model[0].weight], modifier_rank=0):
            with torch.no_grad():
                model[0].weight.fill_(3.0)
        os.write(write, b"written")
    except RuntimeError as e:
        os.write(write, b"refused" if "forked child" in str(e) else str(e).encode()[:200])
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(read, 300).decode(), torch.equal(engine(x), before))
"""


def test_a_forked_child_cannot_write_the_parents_shard(tmp_path):
    """Memory is copied on write across fork(); the shard's file is shared,
    so a child's write would reach the parent's parameters."""
    done = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["refused", "True"], done.stdout


def test_cpu_offload_of_a_cpu_model_changes_nothing():
    """HuggingFace's zero3 template asks for it; the shard is in host
    memory already."""
    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",
                                                                  "pin_memory": True}}}
    torch.manual_seed(0)
    model = Net()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()),
                             config=config)
    assert engine.config.offload_param.device == "cpu"
    assert all(fg.param_files is None for fg in engine.all_groups)
    engine.backward(loss_of(engine(batches("cpu", 1)[0][0]), batches("cpu", 1)[0][1]))
    engine.step()
    engine.close()


def test_refusals(tmp_path, monkeypatch):
    model = Net()
    with pytest.raises(ValueError, match="offload_param .*needs stage 3.*stage is 2"):
        zero.initialize(model, stage=2, offload_param={"device": "nvme",
                                                       "nvme_path": str(tmp_path)})
    with pytest.raises(ValueError, match="offload_param.device='nvme' needs nvme_path"):
        zero.initialize(model, stage=3, offload_param={"device": "nvme"})
    with pytest.raises(ValueError, match="offload_param.device must be"):
        zero.initialize(model, stage=3, offload_param={"device": "disk"})
    with pytest.raises(ValueError, match="offload_param has no field 'buffer_count'"):
        zero.initialize(model, stage=3, offload_param={"device": "cpu", "buffer_count": 4})
    with pytest.raises(ValueError, match="offload_param.nvme_path .* is not a directory"):
        zero.initialize(model, stage=3, offload_param={"device": "nvme",
                                                       "nvme_path": str(tmp_path / "none")})
    with pytest.raises(ValueError, match="zero_optimization.offload_param.nvme_dir"):
        zero.Config.from_deepspeed({"zero_optimization": {
            "stage": 3, "offload_param": {"device": "nvme", "nvme_dir": "/x"}}})
    assert all(p.numel() > 0 for p in model.parameters())


def test_a_deepspeed_config_is_read():
    cfg = zero.Config.from_deepspeed({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local",
                                      "pin_memory": True, "buffer_count": 5,
                                      "buffer_size": 1e8, "max_in_cpu": 1e9}}})
    assert (cfg.offload_param.device, cfg.offload_param.nvme_path) == ("nvme", "/local")
    auto = zero.Config.from_deepspeed({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "auto"}}})
    assert auto.offload_param.device == "none"


PEAK_SCRIPT = """
    nvme, offload_params = sys.argv[1], sys.argv[2] == "1"
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    options = {"offload_optimizer": {"device": "nvme", "nvme_path": nvme,
                                     "chunk_elements": 1 << 18}}
    if offload_params:
        options["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()),
                             stage=3, precision="bf16", **options)
    engine.backward(engine(x).float().square().mean())
    engine.step()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the construction peak no longer counts
    for _ in range(2):
        engine.backward(engine(x).float().square().mean())
        engine.step()
    print(status("VmHWM") - base, engine.memory_summary()["params_offloaded"])
"""


def test_an_offloaded_shard_is_not_held_in_ram(tmp_path):
    """8.4M parameters in bf16: a 16 MiB shard at one rank. The peak
    resident memory of training steps (states on nvme either way) falls by
    the shard, less the step's chunk of it and the allocator's slack
    (allowed: 4 MiB)."""
    def peak(offload_params):
        return run_peak_script(PEAK_SCRIPT, str(tmp_path), "1" if offload_params else "0")
    in_memory, _ = peak(False)
    offloaded_peak, shard = peak(True)
    assert shard >= 2 * 8 * 1024 * 1025
    assert in_memory - offloaded_peak >= shard - 4 * 2**20, (in_memory, offloaded_peak, shard)


def test_a_close_without_room_leaves_the_engine_running(tmp_path):
    """close() first makes the file its file-backed parameters come back in;
    with no room for it (a file size limit here, a full disk alike) it
    raises and the engine is as it was: it trains on, and a later close()
    gives the trained values back. Before, the hooks were gone by then and
    the next forward failed on a placeholder's shape."""
    import resource
    engine = run("bf16", "adamw", param_path=tmp_path, steps=1,
                 stage3_param_persistence_threshold=0)  # released units: hooks needed
    expected = engine.full_state_dict()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # Python ignores SIGXFSZ
    try:
        with pytest.raises(OSError, match="offload_param.nvme_path .* cannot reserve"):
            engine.close()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not engine._closed
    tokens, targets = batches("cpu", 1)[0]
    loss = loss_of(engine(tokens), targets)
    engine.backward(loss)
    engine.zero_grad()  # trains on; the step left out, so the values stay
    engine.close()
    for name, p in engine.module.named_parameters():  # the fp32 model, its masters
        assert p.dtype == torch.float32 and torch.equal(p.detach(), expected[name]), name


def test_close_gives_back_file_backed_parameters_and_states(tmp_path):
    """close() of an engine whose parameters and states lived in files: the
    model's parameters and the optimizer's states come back as views of
    mapped files, equal to what an in-memory engine gives back, and none
    of their pages is resident after close (a model larger than memory can
    be closed)."""
    expected = run("bf16", "adamw", steps=2)
    expected.close()
    engine = run("bf16", "adamw", param_path=tmp_path, states_path=tmp_path, steps=2)
    engine.close()
    model_ref, model = expected.module, engine.module
    opt_ref, opt = expected.optimizer, engine.optimizer
    given = list(model.parameters()) + [t for p in model.parameters()
                                        for t in opt.state[p].values() if t.numel() > 1]
    assert len(given) == 3 * len(list(model.parameters()))  # params, exp_avg, exp_avg_sq
    # nothing resident before anything reads them; each lies in a mapping
    # (smaps lists it), which reading then brings in
    assert [mapped_rss(t) for t in given] == [0] * len(given)
    for (name, ref), (_, got) in zip(model_ref.named_parameters(), model.named_parameters()):
        assert torch.equal(got, ref), name
        assert mapped_rss(got) > 0, name
    for p_ref, p in zip(model_ref.parameters(), model.parameters()):
        for key, value in opt_ref.state[p_ref].items():
            assert torch.equal(opt.state[p][key], value), key
    assert os.listdir(tmp_path) == []
    # the optimizer steps on the file-backed views as torch would on its own
    torch.optim.AdamW.step(opt)


SAVE_LOAD_PEAK_SCRIPT = """
import os
path = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(16)])
place = {"device": "nvme", "nvme_path": path}
engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                         precision="bf16", offload_param=place,
                         offload_optimizer=dict(place, chunk_elements=1 << 18),
                         stage3_param_persistence_threshold=0)
engine.backward(engine(x).float().square().mean())
engine.step()
files = engine.memory_summary()
gc.collect()
start = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
engine.save_checkpoint(os.path.join(path, "ckpt"))
engine.load_checkpoint(os.path.join(path, "ckpt"))
print(status("VmHWM") - start, files["offloaded"] + files["params_offloaded"])
"""


def test_saving_and_loading_a_model_on_a_disk_holds_little_of_it(tmp_path):
    """16.8M parameters with the shard and the fp32 master and moments in
    files (235 MiB): a checkpoint's save and load (torch.save reading the
    files' mappings, the CRC check, torch.load(mmap=True) and the copies
    into the files) raise the resident peak by a fraction of that, not by
    the model states as they did (by 1.1x for the save and 2x for the load
    of a 0.3B model). Allowed: half of the files' bytes, since at this size
    torch.save's whole write takes about as long as a few of the 20 ms
    between drops of its pages (at 0.3B the save rose by 0.06x)."""
    rise, in_files = run_peak_script(SAVE_LOAD_PEAK_SCRIPT, str(tmp_path))
    assert in_files >= 14 * 16 * 2**20
    assert rise < in_files / 2, (rise, in_files)


def test_a_load_of_many_small_parameters_drops_pages_by_the_chunk(tmp_path, monkeypatch):
    """2,000 small parameters with the shard and the states in files: the
    load drops the pages it read once per _COPY_CHUNK elements copied, not
    after every parameter's key, since each drop walks every tensor of the
    checkpoint (8,000 parameters took 53 s to load, 0.16 s to save). The
    values load whole either way."""
    from zero.checkpoint import _format
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(1000)])
    place = {"device": "nvme", "nvme_path": str(tmp_path)}
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=3, offload_param=place, offload_optimizer=place)
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    saved = engine.full_state_dict()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()  # moved on: the load must bring every value back
    drops = []
    real = _format.CheckpointReader.drop_pages
    monkeypatch.setattr(_format.CheckpointReader, "drop_pages",
                        lambda reader, mappings: (drops.append(1), real(reader, mappings)))
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert 1 <= len(drops) <= 2, len(drops)  # 6,000 before (2,000 parameters x 3 keys)
    loaded = engine.full_state_dict()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    engine.close()


def test_close_of_many_small_units_trims_the_heap_by_the_byte(tmp_path, monkeypatch):
    """close() with parameters in files trims the heap every TRIM_BYTES of
    gathered units it lets go, not after each unit (a trim walks the heap:
    8,000 small units took 1.8 s to close against 0.4 s), and the model
    comes back whole either way."""
    from zero.engine import _handback
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(500)])
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, offload_param={"device": "nvme", "nvme_path": str(tmp_path)},
                             units="module")
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    trained = engine.full_state_dict()
    trims = []
    real = _handback.release_freed_memory
    monkeypatch.setattr(_handback, "release_freed_memory", lambda: (trims.append(1), real()))
    engine.close()
    assert len(trims) == 1, len(trims)  # 500 before: one a unit
    assert all(torch.equal(p.detach(), trained[n]) for n, p in model.named_parameters())
