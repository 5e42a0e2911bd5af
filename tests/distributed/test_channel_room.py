"""Stages 2-3 with many param groups on 2 ranks ([Note: channel room] in
comm/_channel_room.py): each group reduces on a process group of its own,
a few file descriptors each. With the hard limit too low, every rank
raises a named error before any channel is made (gloo aborted the job
from accept() with "Too many open files", 250 groups under ulimit -n 1024);
with only the soft limit low, the engine raises it and trains. Small
groups share one channel ([Note: small groups' buckets] in
sharding/_buckets.py): 40 of them train under the hard limit that 40
channels would pass."""
import harness

GROUPS = 40


def _worker(rank, world, hard_low: bool, bucket=16, room=100):
    import os
    import resource

    import torch
    import torch.distributed as dist
    from torch import nn

    import zero
    dist.init_process_group("gloo")
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = len(os.listdir("/proc/self/fd")) + room  # room for the program, not the channels
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, low if hard_low else hard))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(GROUPS)])
    # layer-wise learning-rate decay: a group a layer
    groups = [{"params": list(m.parameters()), "lr": 0.01 * 0.9 ** i}
              for i, m in enumerate(model)]
    # reduce_bucket_size: 16 elements keep each group on a channel of its own
    made = len(dist.distributed_c10d._world.pg_map)
    try:
        engine = zero.initialize(model, optimizer=torch.optim.AdamW(groups), stage=2,
                                 reduce_bucket_size=bucket)
    except RuntimeError as error:
        return "refused", str(error), low
    engine.backward(engine(torch.randn(2, 4)).square().mean())
    engine.step()
    made = len(dist.distributed_c10d._world.pg_map) - made
    return "trained", resource.getrlimit(resource.RLIMIT_NOFILE)[0], low, made


def test_too_few_descriptors_is_refused_on_every_rank():
    results = harness.run(2, _worker, True)
    lowest = min(low for _outcome, _message, low, *_rest in results)
    for outcome, message, *_rest in results:
        assert outcome == "refused"
        assert f"{GROUPS} param groups at stage 2 reduce their gradients on {GROUPS} " \
            "process groups of their own" in message
        assert f"rank(s) [0, 1] may open at most {lowest}" in message
        assert "Merge the param groups that share their settings" in message


def test_a_low_soft_limit_is_raised_and_the_run_trains():
    results = harness.run(2, _worker, False)
    for outcome, soft, low, made in results:
        assert outcome == "trained" and soft > low and made == GROUPS


def test_small_groups_share_one_channel():
    """The default bucket holds every group: they wait for the end of the
    backward and share one channel, so a hard limit that 40 channels pass
    (5 descriptors each on 2 ranks, and the 256 kept for the program)
    leaves room (before: refused as above)."""
    results = harness.run(2, _worker, True, 25_000_000, 320)
    for outcome, _soft, _low, made in results:
        assert outcome == "trained" and made == 1
