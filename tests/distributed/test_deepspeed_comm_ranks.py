"""zero.deepspeed.comm on 2 gloo ranks: the collectives a DeepSpeed script
makes on its own tensors (`from deepspeed import comm as dist`), with
DeepSpeed's profiling arguments taken, give torch.distributed's results."""
import os

import torch

import harness


def _on_rank(rank, world):
    from zero.deepspeed import comm as dist
    dist.init_distributed(dist_backend="gloo")  # from the launcher's environment
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, op=dist.ReduceOp.SUM, log_name="loss")
    b = torch.tensor([float(rank * 10)])
    dist.broadcast(b, src=1)
    parts = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([float(rank)]))
    dist.barrier()
    got = (dist.get_rank(), dist.get_world_size(), dist.is_initialized(), t.item(), b.item(),
           [p.item() for p in parts], dist.get_local_rank() == int(os.environ["LOCAL_RANK"]))
    dist.destroy_process_group()
    return got


def test_deepspeed_comm_calls_on_two_ranks():
    for rank, got in enumerate(harness.run(2, _on_rank)):
        assert got == (rank, 2, True, 3.0, 10.0, [0.0, 1.0], True)


def test_before_any_group_a_script_is_rank_0_of_1(monkeypatch):
    from zero.deepspeed import comm as dist
    import torch.distributed
    if torch.distributed.is_initialized():
        return  # a group of an earlier test in this process: nothing to check here
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank()) == (0, 1, 0)
    assert not dist.is_initialized()
