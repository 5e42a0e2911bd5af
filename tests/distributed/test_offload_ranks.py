"""offload_optimizer on 2 and 3 gloo ranks: "nvme", each rank's master and
states in its own files, stepped through the RAM windows in many chunks;
the staged step of a GPU model's host-offloaded states; and at stage 3
offload_param "nvme", each rank's parameter shard in a file.

In each launch every rank trains the same model twice, states in memory and
then in files, bf16, with clipping (the norm summed over ranks) and
accumulation; at stage 3 rank 0 also changes a weight through
zero.GatheredParameters, which writes into the master's file. The update
is the same C code over the same values chunk by chunk, so the two runs
must agree bit for bit. Tolerance: none."""
import tempfile

import pytest
import torch
from torch import nn

import harness
from engine_cases import mapped_rss

WORLDS = [2, 3]
STEPS = 4
CHUNK = 1024  # the smallest chunk: every partition spans several


def mlp():
    """~45k parameters: a rank's partition is well over 3 chunks at 3 ranks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(97, 211), nn.GELU(), nn.Linear(211, 113), nn.GELU(),
                         nn.Linear(113, 29))


def train(rank, world, stage, nvme_path, staged=False, param_path=None):
    """staged: the master and states in host memory apart from the model,
    the staged step a GPU model takes (made to run on the CPU here, as in
    tests/test_staged_step.py). param_path: stage 3's parameter shard in a
    file there (offload_param "nvme")."""
    import torch.distributed as dist
    import zero
    from engine_cases import place_apart
    place_apart(params=False, states=staged)
    model = mlp()
    options = {}
    if nvme_path is not None:
        options["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path,
                                        "chunk_elements": CHUNK}
    elif staged:
        options["offload_optimizer"] = {"device": "cpu"}
    if param_path is not None:
        options["offload_param"] = {"device": "nvme", "nvme_path": param_path}
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=stage, precision="bf16", gradient_clipping=0.5,
                             gradient_accumulation_steps=2, **options)
    facts = {}
    if nvme_path is not None:
        facts["chunks"] = min(len(fg.offload.chunks(fg.part_size)) for fg in engine.groups)
    facts["staged"] = all(fg.staged for fg in engine.groups)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        for _ in range(2):
            x = torch.randn(8, 97, generator=g)
            engine.backward(engine(x).float().square().mean())
            engine.step()
        if stage == 3 and step == 1:
            with zero.GatheredParameters([model[0].weight], modifier_rank=0):
                with torch.no_grad():
                    model[0].weight[0].mul_(0.5 if rank == 0 else 7.0)
            if nvme_path is not None:  # the write-back left no master page mapped
                facts["master_rss"] = sum(mapped_rss(fg.master) for fg in engine.groups)
            if param_path is not None:  # nor a page of the shard
                facts["shard_rss"] = sum(mapped_rss(fg.shard) for fg in engine.groups)
    state = engine.full_state_dict()
    states = {(fg.index, k): v.clone() for fg in engine.groups for k, v in fg.states.items()}
    masters = {fg.index: fg.master.clone() for fg in engine.groups}
    facts["offloaded"] = engine.memory_summary()["offloaded"]
    facts["params_offloaded"] = engine.memory_summary()["params_offloaded"]
    engine.close()
    dist.barrier()
    return state, states, masters, facts


def both_ways(rank, world):
    with tempfile.TemporaryDirectory(prefix=f"zero-nvme-r{rank}-") as directory:
        runs = {stage: (train(rank, world, stage, None), train(rank, world, stage, directory),
                        train(rank, world, stage, None, staged=True))
                for stage in (1, 2, 3)}
        # stage 3 with the parameter shard in a file too, with the states and alone
        runs[3] += (train(rank, world, 3, directory, param_path=directory),
                    train(rank, world, 3, None, param_path=directory))
    return runs


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def runs(request):
    return request.param, harness.run(request.param, both_ways)


def same(expected, got, where):
    """(state dict, states, masters) of two runs equal bit for bit."""
    for label, ref, ours in zip(("", "state ", "master "), expected, got):
        for key, value in ref.items():
            assert torch.equal(ours[key], value), f"{where}: {label}{key}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_ranks_equal_the_in_memory_ranks(runs, stage):
    world, results = runs
    for rank, result in enumerate(results):
        (state, states, masters, _), (o_state, o_states, o_masters, facts), staged = \
            result[stage][:3]
        where = f"world {world} stage {stage} rank {rank}"
        assert facts["chunks"] > 3, where  # the windows were reused
        assert facts["offloaded"] > 0, where
        same((state, states, masters), (o_state, o_states, o_masters), f"{where} nvme")
        if stage == 3:
            assert facts["master_rss"] == 0, where
        # the staged step (host states apart from the model) agrees too
        assert staged[3]["staged"], where
        same((state, states, masters), staged[:3], f"{where} staged")
        # the parameter shard in a file (offload_param "nvme") agrees too,
        # and the write through GatheredParameters left none of it mapped
        for label, run in zip(("params+states", "params"), result[stage][3:]):
            assert run[3]["params_offloaded"] > 0 and run[3]["shard_rss"] == 0, where
            same((state, states, masters), run[:3], f"{where} offload_param {label}")
    # the change through GatheredParameters took rank 0's value everywhere
    if stage == 3:
        first = results[0][stage][1][0]["0.weight"]
        for result in results[1:]:
            assert torch.equal(result[stage][1][0]["0.weight"], first)


def prefetched_chunks(rank, world):
    """12 layers of 256 (a rank's chunk of each is larger than the 64 KiB
    the kernel maps around a fault), the shard in a file, the default
    prefetch (every later unit gathered ahead at the first module). Each
    layer's forward takes a moment, so the prefetched gathers are done by
    the next layer's; the shard's resident bytes are read there, at every
    layer from the third."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(12)])
    with tempfile.TemporaryDirectory(prefix=f"zero-prefetch-r{rank}-") as directory:
        return _prefetched_chunks_in(directory, model)


def _prefetched_chunks_in(directory, model):
    import time
    import zero
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             stage=3, stage3_param_persistence_threshold=0,
                             offload_param={"device": "nvme", "nvme_path": directory})
    shard = sum(fg.shard.nbytes for fg in engine.all_groups)
    seen = []

    def measure(module, _args):
        if module is not model[0] and module is not model[1]:
            seen.append(sum(mapped_rss(fg.shard) for fg in engine.all_groups))

    for layer in model:
        layer.register_forward_pre_hook(measure)
        layer.register_forward_hook(lambda *_: time.sleep(0.05))
    for step in range(2):  # the second forward prefetches along the recorded order
        seen.clear()
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
    engine.close()
    return max(seen), shard


def test_a_prefetched_units_chunk_is_unmapped_once_gathered():
    """Before, each prefetched unit kept its chunk of the shard mapped until
    its module ran: 71% of the shard was resident inside a forward here
    (1.12 of 1.58 MB); now none."""
    for top, shard in harness.run(2, prefetched_chunks, timeout=120):
        assert top <= shard // 4, (top, shard)


def _one_bad_path(rank, world, directory):
    """Rank 1's nvme_path does not exist; rank 0's does (paths may differ
    per rank). Returns what initialize raised here."""
    import os

    import zero
    path = directory if rank == 0 else os.path.join(directory, "missing")
    model = mlp()
    try:
        zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=2,
                        offload_optimizer={"device": "nvme", "nvme_path": path})
    except ValueError as error:
        return str(error)
    return None


def test_a_path_refused_on_one_rank_stops_every_rank(tmp_path):
    """Each rank checks its own nvme_path; the refusal is shared before the
    engine's first collective, so the other rank raises at once instead of
    waiting there for the process group's timeout."""
    errors = harness.run(2, _one_bad_path, str(tmp_path), timeout=120)
    assert "offload_optimizer.nvme_path" in errors[1] and "is not a directory" in errors[1]
    assert errors[0] == ("zero.initialize: rank(s) [1] refused their nvme_path (each rank "
                         "checks its own; their errors say why), so no rank goes on")


def _short_disks(rank, world, directory, shared):
    """Initialize with offload_optimizer "nvme" where the disks lack room
    ([Note: disk room]): shared, both ranks' paths on one disk whose free
    space holds one rank's files but not both; else rank 1's disk, on
    another machine, is full. Returns (errno, message) of what initialize
    raised here, else None."""
    import zero
    import zero.engine._disk_room as disk_room
    from zero.engine._arguments import resolve_config
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters())
    options = {"offload_optimizer": {"device": "nvme", "nvme_path": directory}}
    if shared:
        cfg = resolve_config(None, 2, None, options)
        [(_, _, need)] = disk_room._needs(model, optimizer, cfg, world, torch.device("cpu"))
        free = 2 * (need + disk_room.SLACK) - 1
        disk_room.free_bytes = lambda path: free
    elif rank == 1:
        disk_room.free_bytes = lambda path: 0
        disk_room.machine_id = lambda: 12345
    try:
        zero.initialize(model, optimizer=optimizer, stage=2, **options)
    except OSError as error:
        return error.errno, str(error)
    return None


@pytest.mark.parametrize("shared", [False, True])
def test_a_disk_without_room_on_one_rank_stops_every_rank(tmp_path, shared):
    """Before the engine's collectives make the files: a full disk on one
    rank, or two ranks' files summed on one disk, refused on every rank at
    once (before: the rank that failed to make its file raised alone, and
    the other waited in the layout's next collective until the timeout)."""
    import errno
    (first, text0), (second, text1) = harness.run(2, _short_disks, str(tmp_path), shared,
                                                  timeout=120)
    assert first == second == errno.ENOSPC
    if shared:
        for text in (text0, text1):
            assert f"offload_optimizer.nvme_path '{tmp_path}' has " in text
            assert "the offload files of rank(s) [0, 1] on that disk need" in text
    else:
        assert "has 0.00 MiB (0 bytes) free, but the offload files of rank(s) [1] on that " \
               "disk need" in text1
        assert text0.endswith("the offload disk(s) of rank(s) [1] lack room for their files "
                              "(their errors say how much), so no rank goes on")


def _files_on_one_rank(rank, world, directory):
    """offload_optimizer "nvme" on rank 0 alone: the settings differ."""
    import zero
    model = mlp()
    device = {"device": "nvme", "nvme_path": directory} if rank == 0 else {"device": "cpu"}
    try:
        zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=2,
                        offload_optimizer=device)
    except ValueError as error:
        return str(error)
    return None


def test_files_on_one_rank_only_are_named_as_different_settings(tmp_path):
    """The disk check's gather runs on every rank: on the rank with files
    alone it met the settings' agreement, and gloo aborted."""
    for error in harness.run(2, _files_on_one_rank, str(tmp_path), timeout=120):
        assert error is not None and "the ranks differ in their settings" in error, error


def close_with_one_rank_short_of_room(rank, world, fail):
    """Stage 3, parameters in files: close() makes each rank a file for
    its whole parameters. fail: rank 1's files are limited to a page then
    (RLIMIT_FSIZE, as `ulimit -f`), so its file fails (EFBIG). Every rank
    must raise at once and train on; a second close(), with room, closes.
    Returns (the errors of the first close, the state after the second)."""
    with tempfile.TemporaryDirectory(prefix=f"zero-close-r{rank}-") as directory:
        return _close_short_of_room_in(directory, rank, fail)


def _close_short_of_room_in(directory, rank, fail):
    import resource
    import zero
    model = mlp()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                             stage=3, stage3_param_persistence_threshold=0, timeout=60,
                             offload_param={"device": "nvme", "nvme_path": directory})

    def step(k):
        x = torch.randn(8, 97, generator=torch.Generator().manual_seed(10 * k + rank))
        engine.backward(engine(x).float().square().mean())
        engine.step()
    step(0)
    errors = []
    if fail:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
        try:
            engine.close()
        except (OSError, RuntimeError) as error:
            errors.append(f"{type(error).__name__}: {error}")
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    step(1)  # every rank trains on: the steps' collectives meet
    engine.close()
    return errors, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_close_that_fails_on_one_rank_fails_on_every_rank():
    """Before, rank 1 raised alone and rank 0 waited in close()'s gathers
    until the timeout, or met rank 1's next forward with them (offload
    hunt)."""
    failed = harness.run(2, close_with_one_rank_short_of_room, True, timeout=240)
    clean = harness.run(2, close_with_one_rank_short_of_room, False, timeout=240)
    (errors0, state0), (errors1, state1) = failed
    assert len(errors0) == 1 and errors0[0].startswith("RuntimeError") and \
        "rank(s) [1]" in errors0[0] and "no rank closed" in errors0[0], errors0
    assert len(errors1) == 1 and errors1[0].startswith("OSError") and \
        "offload_param.nvme_path" in errors1[0], errors1
    for state, (_, expected) in zip((state0, state1), clean):
        assert state.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(state[name], value), name
