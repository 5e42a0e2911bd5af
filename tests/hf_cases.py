"""What the HuggingFace model tests share: a process with no launcher, and
the loop that trains a model under the engine beside its torch twin."""
import os

import pytest
import torch
import torch.distributed as dist

import engine_cases


@pytest.fixture
def one_process(monkeypatch):
    engine_cases.no_launcher(monkeypatch)
    # TrainingArguments writes its choices into os.environ (accelerate reads
    # them back, in this process and in the workers later tests spawn)
    environment = dict(os.environ)
    had_group = dist.is_initialized()
    yield
    os.environ.clear()
    os.environ.update(environment)
    assert dist.is_initialized() == had_group, "an engine left its process group behind"


def train_side_by_side(engine, ref, ref_opt, steps=3, clip=None, vocab=128):
    """`steps` causal-LM steps on the same random tokens; each loss of the
    engine within 1e-5 of the twin's (the same ops forward)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 16), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
