"""zero.estimate_memory(model, N) on 2 and 3 gloo ranks: every rank's
memory_summary() after a training step equals the estimate made for N
ranks, byte for byte (padding to N partitions, stage 3's units, offload
windows), as tests/test_estimate.py checks at one rank."""
import tempfile

import pytest
import torch
from torch import nn

import harness

WORLDS = [2, 3]
EXACT = ["params", "grads", "optimizer_states", "offloaded", "persistent", "frozen_params",
         "trainable_params"]


def model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(37, 101), nn.GELU(), nn.Linear(101, 53), nn.LayerNorm(53),
                        nn.Linear(53, 11))
    net[0].requires_grad_(False)
    return net


def cases(nvme_path):
    return {
        (stage, name): options
        for stage in (0, 1, 2, 3)
        for name, options in {
            "bf16": dict(precision="bf16"),
            "fp32 accumulate": dict(precision="bf16", grad_accum_dtype="fp32"),
            "persistent": dict(precision="bf16", stage3_param_persistence_threshold=1000),
            "nvme": dict(precision="bf16", offload_optimizer={
                "device": "nvme", "nvme_path": nvme_path, "chunk_elements": 1024}),
        }.items()
    }


def summaries(rank, world):
    import zero
    out = {}
    for (stage, name), options in cases(tempfile.gettempdir()).items():
        net = model()
        engine = zero.initialize(net, stage=stage, **options)
        g = torch.Generator().manual_seed(rank)
        engine.backward(engine(torch.randn(4, 37, generator=g)).float().square().mean())
        engine.step()
        out[(stage, name)] = dict(engine.memory_summary())
        engine.close()
    return out


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def runs(request):
    return request.param, harness.run(request.param, summaries)


def test_every_rank_holds_what_was_estimated(runs):
    import zero
    world, results = runs
    for key, options in cases(tempfile.gettempdir()).items():
        estimate = zero.estimate_memory(model(), world, stage=key[0], **options)
        for rank, result in enumerate(results):
            summary = result[key]
            for field in EXACT:
                assert estimate[field] == summary[field], (world, key, rank, field)
            assert estimate["model_states"] == \
                summary["model_states"] - summary["gathered_peak"], (world, key, rank)
