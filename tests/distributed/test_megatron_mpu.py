"""deepspeed.initialize(mpu=...) with a Megatron-style model split by hand
([Note: mpu] in python/zero/parallel/_mpu.py), on 4 gloo ranks: model
parallel 2 x data parallel 2. The model: a replicated LayerNorm, a
column-parallel Linear (its rows split, marked tensor_model_parallel),
GELU, a row-parallel Linear (its columns split; the partial outputs summed
over the model-parallel group, Megatron's g), a replicated bias added
after the sum, a replicated head; Megatron's f (identity forward,
gradient summed over the model-parallel group) before the split layer.
Against one process of torch on the unsplit model and the global batch:
SGD with momentum, clipping active (max norm 0.05, below the measured
norm: a norm that counted the replicated parameters twice, or missed the
other rank's slices, clips by another factor), at ZeRO stages 1 and 3,
losses and every parameter at 1e-5; then a checkpoint (one per
model-parallel rank) reloaded and resumed bit for bit."""
import pytest
import torch
from torch import nn

import harness

D, H, BATCH, STEPS, MAX_NORM = 6, 8, 8, 3, 0.05


class Full(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.fc2(nn.functional.gelu(self.fc1(self.norm(x)))))


def full_model():
    torch.manual_seed(0)
    return Full()


def data():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, D, generator=g), torch.randn(BATCH, 1, generator=g))
            for _ in range(STEPS + 1)]


class Mpu:
    """Megatron's mpu over 4 ranks: model-parallel pairs {0,1}, {2,3}."""

    def __init__(self, rank):
        import torch.distributed as dist
        mp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        self.mp, self.dp = mp[rank // 2], dp[rank % 2]
        self.mp_rank, self.dp_rank = rank % 2, rank // 2

    def get_model_parallel_group(self):
        return self.mp

    def get_data_parallel_group(self):
        return self.dp

    def get_model_parallel_world_size(self):
        return 2

    def get_model_parallel_rank(self):
        return self.mp_rank


def split_model(mpu):
    import torch.distributed as dist

    class CopyToModelParallel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=mpu.mp)
            return grad

    class ReduceFromModelParallel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.clone()
            dist.all_reduce(x, group=mpu.mp)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad

    full = full_model()
    r, half = mpu.mp_rank, H // 2

    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = full.norm
            self.fc1 = nn.Linear(D, half)
            self.fc2 = nn.Linear(half, D, bias=False)
            self.bias2 = nn.Parameter(full.fc2.bias.detach().clone())
            self.head = full.head
            with torch.no_grad():
                self.fc1.weight.copy_(full.fc1.weight[r * half:(r + 1) * half])
                self.fc1.bias.copy_(full.fc1.bias[r * half:(r + 1) * half])
                self.fc2.weight.copy_(full.fc2.weight[:, r * half:(r + 1) * half])
            for p in (self.fc1.weight, self.fc1.bias, self.fc2.weight):
                p.tensor_model_parallel = True

        def forward(self, x):
            h = CopyToModelParallel.apply(self.norm(x))
            h = self.fc2(nn.functional.gelu(self.fc1(h)))
            return self.head(ReduceFromModelParallel.apply(h) + self.bias2)

    return Split()


def train(rank, world, stage, directory):
    import zero.deepspeed as deepspeed
    deepspeed.init_distributed(dist_backend="gloo")  # as a Megatron script, before its mpu
    mpu = Mpu(rank)
    model = split_model(mpu)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        mpu=mpu, config={"train_micro_batch_size_per_gpu": BATCH // 2,
                         "gradient_clipping": MAX_NORM, "zero_optimization": {"stage": stage}})
    assert engine.dp_world_size == 2
    # DeepSpeed's layout queries answer from the mpu given
    assert engine.mp_world_size == 2
    assert engine.get_model_parallel_rank() == engine.get_tensor_parallel_rank() == mpu.mp_rank
    assert engine.get_data_parallel_rank() == mpu.dp_rank
    rows = slice(mpu.dp_rank * BATCH // 2, (mpu.dp_rank + 1) * BATCH // 2)

    def step(x, y):
        loss = nn.functional.mse_loss(engine(x[rows]), y[rows])
        engine.backward(loss)
        engine.step()
        return loss.item(), engine.get_global_grad_norm()
    batches = data()
    losses, norms = [], []
    for x, y in batches[:STEPS]:
        loss, norm = step(x, y)
        losses.append(loss)
        norms.append(norm)
    engine.save_checkpoint(directory)
    state = engine.full_state_dict()
    after = step(*batches[STEPS])[0]
    engine.load_checkpoint(directory)
    again = step(*batches[STEPS])[0]
    engine.close()
    return losses, norms, state, after, again


def reference():
    model = full_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, norms = [], []
    for x, y in data()[:STEPS]:
        halves = [nn.functional.mse_loss(model(x[i * BATCH // 2:(i + 1) * BATCH // 2]),
                                         y[i * BATCH // 2:(i + 1) * BATCH // 2])
                  for i in range(2)]
        loss = (halves[0] + halves[1]) / 2
        optimizer.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        losses.append([h.item() for h in halves])
    return losses, norms, model


@pytest.mark.parametrize("stage", [1, 3])
def test_a_megatron_split_model_trains_as_the_whole_one(tmp_path, stage):
    results = harness.run(4, train, stage, str(tmp_path / "ckpt"), timeout=180)
    losses, norms, model = reference()
    assert all(n > MAX_NORM for n in norms)  # clipping is active every step
    for rank, (got_losses, got_norms, state, after, again) in enumerate(results):
        dp_rank, mp_rank = rank // 2, rank % 2
        for step, (ours, theirs) in enumerate(zip(got_losses, losses)):
            assert abs(ours - theirs[dp_rank]) <= 1e-5 * abs(theirs[dp_rank]), (rank, step)
        for ours, theirs in zip(got_norms, norms):
            assert abs(ours - theirs) <= 1e-5 * theirs, (rank, got_norms, norms)
        half = slice(mp_rank * H // 2, (mp_rank + 1) * H // 2)
        expected = {"norm.weight": model.norm.weight, "norm.bias": model.norm.bias,
                    "fc1.weight": model.fc1.weight[half], "fc1.bias": model.fc1.bias[half],
                    "fc2.weight": model.fc2.weight[:, half], "bias2": model.fc2.bias,
                    "head.weight": model.head.weight, "head.bias": model.head.bias}
        for name, value in expected.items():
            error = (state[name] - value.detach()).norm() / value.detach().norm()
            assert error <= 1e-5, (rank, name, float(error))
        assert after == again, rank  # the checkpoint resumed exactly
    assert (tmp_path / "ckpt" / "mp_rank_00" / "latest").exists()
    assert (tmp_path / "ckpt" / "mp_rank_01" / "latest").exists()
