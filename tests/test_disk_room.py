"""The room check of offload files ([Note: disk room] in
engine/_disk_room.py), in one process: the bytes it counts for a rank are
the bytes its files then take (offload_optimizer and offload_param "nvme",
stages 1-3, two param groups, a frozen group, zero.inference), and with
the free space made short it refuses with ENOSPC before any file is made,
the model left as it was. The refusal shared by ranks:
tests/distributed/test_offload_ranks.py."""
import errno
import os

import pytest
import torch
from torch import nn

import zero
import zero.engine._disk_room as disk_room
from zero.engine._arguments import resolve_config


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(61, 97), nn.GELU(), nn.Linear(97, 43), nn.LayerNorm(43))
    model[3].requires_grad_(False)  # a frozen group at stage 3
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.requires_grad]
    rest = [p for n, p in model.named_parameters()
            if not n.endswith("weight") and p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}])
    return model, optimizer


def options_for(tmp_path, stage, params_too, same_dir=False):
    states = tmp_path / "states"
    params = states if same_dir else tmp_path / "params"
    for d in (states, params):
        d.mkdir(exist_ok=True)
    options = {"stage": stage, "precision": "bf16", "offload_optimizer": {
        "device": "nvme", "nvme_path": str(states), "chunk_elements": 1024}}
    if params_too:
        options["offload_param"] = {"device": "nvme", "nvme_path": str(params)}
    return options


def counted(model, optimizer, options):
    """{block: bytes} the check counts for this rank, before initialize."""
    cfg = resolve_config(None, None, None, options)
    return {block: need for block, _path, need in
            disk_room._needs(model, optimizer, cfg, 1, torch.device("cpu"))}


def file_bytes(engine):
    """{block: bytes} the engine's files take."""
    taken = {"offload_optimizer": 0, "offload_param": 0}
    for fg in engine.all_groups:
        if fg.offload is not None:
            taken["offload_optimizer"] += fg.offload.nbytes
        if fg.param_files is not None:
            taken["offload_param"] += fg.param_files.nbytes
    return {k: v for k, v in taken.items() if v or k in counted_blocks(engine)}


def counted_blocks(engine):
    return [b for b in ("offload_optimizer", "offload_param")
            if getattr(engine.config, b).device == "nvme"]


@pytest.mark.parametrize("stage, params_too", [(1, False), (2, False), (3, False), (3, True)])
def test_the_bytes_counted_are_the_bytes_the_files_take(tmp_path, stage, params_too):
    model, optimizer = model_and_optimizer()
    options = options_for(tmp_path, stage, params_too)
    need = counted(model, optimizer, options)
    engine = zero.initialize(model, optimizer=optimizer, **options)
    assert need == file_bytes(engine)
    assert need["offload_optimizer"] > 0 and need.get("offload_param", 1) > 0
    engine.close()


def sizes_on_disk(engine):
    """{block: bytes} the engine's files hold, as the disk reports them."""
    taken = {}
    for fg in engine.all_groups:
        for block, files in (("offload_optimizer", fg.offload), ("offload_param", fg.param_files)):
            if files is not None:
                taken[block] = taken.get(block, 0) + sum(
                    os.fstat(fd).st_size for fd in files.fds.values())
    return taken


@pytest.mark.parametrize("stage, params_too", [(1, False), (3, True)])
def test_many_small_groups_are_counted_in_whole_pages(tmp_path, stage, params_too):
    """Each file takes whole pages: 40 groups of a Linear(4, 4) hold 3
    files of a few dozen bytes each, which the disk holds as 120 pages (a
    count of their bytes alone said 64x less, and a nearly full disk then
    passed the check and failed on one rank)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(40)])
    optimizer = torch.optim.AdamW([{"params": m.parameters()} for m in model])
    options = options_for(tmp_path, stage, params_too)
    need = counted(model, optimizer, options)
    engine = zero.initialize(model, optimizer=optimizer, **options)
    on_disk = sizes_on_disk(engine)
    assert need == on_disk
    assert on_disk["offload_optimizer"] >= 40 * 3 * 4096
    summary = engine.memory_summary()
    assert summary["offloaded"] == on_disk["offload_optimizer"]
    assert summary["params_offloaded"] == on_disk.get("offload_param", 0)
    engine.close()


def test_inference_counts_its_parameter_files(tmp_path):
    model, _ = model_and_optimizer()
    path = str(tmp_path)
    cfg = resolve_config(None, 3, None, {"offload_param": {"device": "nvme", "nvme_path": path}})
    model.requires_grad_(False)
    placeholder = torch.optim.SGD(model.parameters(), lr=0.0)
    [(block, _, need)] = disk_room._needs(model, placeholder, cfg, 1, torch.device("cpu"))
    engine = zero.inference(model, offload_param={"device": "nvme", "nvme_path": path})
    assert (block, need) == ("offload_param", file_bytes(engine)["offload_param"])
    assert need > 0
    engine.close()


@pytest.mark.parametrize("params_too, same_dir", [(False, False), (True, False), (True, True)])
def test_a_disk_without_room_is_refused_before_any_file(tmp_path, monkeypatch, params_too,
                                                        same_dir):
    """Free space one byte short of what the blocks on that disk need
    together (both blocks on one filesystem, in one directory or two:
    their sum, where each alone would fit)."""
    model, optimizer = model_and_optimizer()
    options = options_for(tmp_path, 3, params_too, same_dir)
    need = counted(model, optimizer, options)
    needed = sum(n + disk_room.SLACK for n in need.values())
    free = needed - 1
    if params_too:
        assert all(free > n + disk_room.SLACK for n in need.values())  # each alone fits
    monkeypatch.setattr(disk_room, "free_bytes", lambda path: free)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opened = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as refused:
        zero.initialize(model, optimizer=optimizer, **options)
    assert refused.value.errno == errno.ENOSPC
    message = str(refused.value)
    assert f"offload_optimizer.nvme_path '{tmp_path / 'states'}' has " \
           f"{disk_room.size_text(free)} free" in message
    assert f"rank(s) [0] on that disk need {disk_room.size_text(needed)}" in message
    assert len(os.listdir("/proc/self/fd")) == opened  # no file made, none left open
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    monkeypatch.undo()
    engine = zero.initialize(model, optimizer=optimizer, **options)  # with room: trains
    engine.backward(engine(torch.randn(4, 61)).square().mean())
    engine.step()
    engine.close()


def test_no_offload_to_files_checks_nothing(monkeypatch):
    def never(path):
        raise AssertionError("free space read without files to make")
    monkeypatch.setattr(disk_room, "free_bytes", never)
    model, optimizer = model_and_optimizer()
    zero.initialize(model, optimizer=optimizer, stage=3,
                    offload_optimizer={"device": "cpu"}).close()
