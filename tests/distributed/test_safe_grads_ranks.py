"""deepspeed.utils.safe_get_full_grad and its companions
(deepspeed/utils/_safe_grads.py) on 1 and 2 gloo ranks: after the
backwards of an accumulation window (2 micro-batches, other data on each
rank) the full gradient is torch's gradient of the mean loss over every
rank's micro-batches ([Note: safe gradients]), at stages 0-3, read again
after the boundary's reduction ran (clip_grad_norm_, after which writes
are refused), on a 2 x 1 hybrid
mesh (replicas), and in fp16 without the loss scale; the local pieces
laid end to end in rank order are the whole; and a gradient written with
the setters is the one the step applies (SGD, lr 0.5: w - 0.5 g)."""
import pytest
import torch
from torch import nn

import harness

CASES = ["stage0", "stage1", "stage2", "stage3", "stage3 released", "stage1 clipped first",
         "stage3 clipped first", "stage2 fp16"]
MESH_CASES = ["hybrid stage2", "hybrid stage1"]
MICRO = 2


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def data(rank, micro):
    g = torch.Generator().manual_seed(100 * rank + micro)
    return torch.randn(4, 6, generator=g)


def loss_of(out):
    return out.float().square().mean()


def _options(case):
    stage = int(case.split("stage")[1][0])
    options = dict(stage=stage, gradient_accumulation_steps=MICRO, gradient_clipping=0.0)
    if "released" in case:
        options["stage3_param_persistence_threshold"] = 0
    if "fp16" in case:
        options["precision"] = "fp16"
    return options


def _on_rank(rank, world, cases):
    import torch.distributed as dist

    import zero
    from zero.deepspeed import utils
    results = {}
    for case in cases:
        model = build()
        options = _options(case)
        if "hybrid" in case:
            from torch.distributed.device_mesh import init_device_mesh
            options["mesh"] = init_device_mesh("cpu", (world, 1),
                                               mesh_dim_names=("dp_replicate", "dp_shard"))
        engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                 **options)
        for m in range(MICRO):
            engine.backward(loss_of(engine(data(rank, m))))
            if m < MICRO - 1:
                engine.step()
        full = {n: utils.safe_get_full_grad(p) for n, p in model.named_parameters()}
        local = {n: utils.safe_get_local_grad(p) for n, p in model.named_parameters()}
        # the setters: a new whole gradient for one, half the local pieces
        # for another (small: the fp16 sums they become hold the loss scale)
        utils.safe_set_full_grad(model[0].weight, torch.full((10, 6), 0.1))
        utils.safe_set_local_grad(model[2].weight, local["2.weight"] * 0.5)
        reread = None
        if "clipped first" in case:
            engine.clip_grad_norm_(1e9)  # runs the boundary's reduction, clips nothing
            # read after the reduction: the gradients the step applies
            reread = {n: utils.safe_get_full_grad(p) for n, p in model.named_parameters()}
            with pytest.raises(RuntimeError, match="write gradients before clip_grad_norm_"):
                utils.safe_set_full_grad(model[0].weight, torch.zeros(10, 6))
            with pytest.raises(RuntimeError, match="write gradients before clip_grad_norm_"):
                utils.safe_set_local_grad(model[2].weight, local["2.weight"])
        set_back = utils.safe_get_full_grad(model[0].weight)
        engine.step()
        assert not engine.step_was_skipped, case
        after = {n: utils.safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
        results[case] = (full, local, set_back, after, reread)
        engine.close()
        if "hybrid" in case:
            dist.barrier()
    return results


def reference(world):
    """torch's gradient of the mean loss over every rank's micro-batches,
    the same with the two written gradients over it, and the weights
    after SGD(lr 0.5) applies that."""
    model = build()
    loss = sum(loss_of(model(data(r, m))) for r in range(world) for m in range(MICRO))
    (loss / (world * MICRO)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    applied = dict(grads)
    applied["0.weight"] = torch.full((10, 6), 0.1)
    applied["2.weight"] = grads["2.weight"] * 0.5
    after = {n: (p - 0.5 * applied[n]).detach() for n, p in model.named_parameters()}
    return grads, applied, after


def _check(world, answers, case):
    grads, applied, after = reference(world)
    fp16 = "fp16" in case
    tol = dict(rtol=2e-2, atol=2e-3) if fp16 else dict(rtol=1e-5, atol=1e-6)
    for full, _local, set_back, got_after, reread in answers:
        for name, g in grads.items():
            torch.testing.assert_close(full[name], g, **tol, msg=f"{case}: {name}")
            torch.testing.assert_close(got_after[name], after[name], **tol,
                                       msg=f"{case}: {name} after the step")
            if reread is not None:
                torch.testing.assert_close(reread[name], applied[name], **tol,
                                           msg=f"{case}: {name} read after the reduction")
        torch.testing.assert_close(set_back, torch.full((10, 6), 0.1), **tol)
    # one partition (stage 0; the 2 x 1 mesh's replicas): each rank's piece
    # is the whole; else the pieces laid end to end in rank order are
    whole_each = case.startswith("hybrid") or case.startswith("stage0")
    for name in grads:
        whole = answers[0][0][name].reshape(-1)
        pieces = [answer[1][name] for answer in answers]
        for got in (pieces if whole_each else [torch.cat(pieces)]):
            torch.testing.assert_close(got, whole, msg=case)


@pytest.mark.parametrize("world", [1, 2])
def test_gradients_read_and_written_as_torchs(world):
    answers = harness.run(world, _on_rank, CASES)
    for case in CASES:
        _check(world, [a[case] for a in answers], case)


def test_gradients_on_a_hybrid_mesh():
    answers = harness.run(2, _on_rank, MESH_CASES)
    for case in MESH_CASES:
        _check(2, [a[case] for a in answers], case)


def test_bad_gradient_values_refused():
    import zero
    from zero.deepspeed import utils
    model = build()
    engine = zero.initialize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                             stage=2)
    with pytest.raises(ValueError, match="safe_set_full_grad: value has 3 elements"):
        utils.safe_set_full_grad(model[0].weight, torch.zeros(3))
    with pytest.raises(ValueError, match="safe_set_local_grad: value has 3 elements"):
        utils.safe_set_local_grad(model[0].weight, torch.zeros(3))
    engine.close()
    assert utils.safe_get_full_grad(nn.Parameter(torch.zeros(2))) is None
