"""ZeroTrainer on 2 gloo ranks against the plain HuggingFace Trainer on the
same 2 ranks (accelerate wraps it in DDP), and a checkpoint folder written
on 2 ranks at stage 3 resumed in one process at stage 1.

Tolerance, fp32: as in tests/test_hf_trainer.py (a few ulps a step between
the C AdamW and torch's fused AdamW), 1e-5 normwise on the parameters and
relative on the gradient norms; the logged losses, which the Trainer rounds
to 4 decimals, within one unit of the last."""
import pytest
import torch

import harness
from conftest import max_rel_error
from hf_trainer_cases import llama, logged, same_logged_loss, token_data, training_args

pytest.importorskip("transformers", reason="requirements-test.txt installs transformers")


def _both_trainers(rank, world, root):
    from transformers import Trainer

    from zero.integrations.hf import ZeroTrainer
    out = {}
    plain = Trainer(model=llama(), args=training_args(f"{root}/plain"),
                    train_dataset=token_data())
    plain.train()
    out["plain"] = ({k: v.detach().clone() for k, v in plain.model.state_dict().items()},
                    logged(plain, "loss"), logged(plain, "grad_norm"),
                    type(plain.model_wrapped).__name__)
    for stage in (0, 2, 3):
        trainer = ZeroTrainer(model=llama(), train_dataset=token_data(),
                              args=training_args(f"{root}/zero{stage}", save_strategy="steps",
                                                 save_steps=3),
                              zero_options={"stage": stage})
        trainer.train()
        out[stage] = (trainer.engine.full_state_dict(), logged(trainer, "loss"),
                      logged(trainer, "grad_norm"), type(trainer.model_wrapped).__name__)
        trainer.engine.close()
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-trainer")
    return root, harness.run(2, _both_trainers, str(root))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_two_ranks_match_the_plain_trainer_under_ddp(two_ranks, stage):
    _root, results = two_ranks
    ref_state, ref_losses, ref_norms, ref_wrapper = results[0]["plain"]
    assert ref_wrapper == "DistributedDataParallel"
    for rank in range(2):
        state, losses, norms, wrapper = results[rank][stage]
        assert wrapper == "Engine"  # no DDP around the engine
        for ours, ref in zip(losses, ref_losses, strict=True):
            assert same_logged_loss(ours, ref)
        for ours, ref in zip(norms, ref_norms, strict=True):
            assert abs(ours - ref) <= 1e-5 * abs(ref)
        for key, ref in ref_state.items():
            assert max_rel_error(state[key], ref) <= 1e-5, key


def test_a_two_rank_folder_resumes_in_one_process_at_another_stage(two_ranks, monkeypatch):
    """The Trainer keeps its per-device batch from the folder, so one
    process sees other batches than 2 ranks did: what must hold is that
    the engine starts from exactly what the 2 ranks saved (read when
    training begins, after the resume), and trains on to the last step."""
    from transformers import TrainerCallback

    from zero.checkpoint import consolidate
    from zero.integrations.hf import ZeroTrainer
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    root, _results = two_ranks
    folder = root / "zero3" / "checkpoint-3"
    seen = {}

    class AtTrainBegin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["state"] = trainer.engine.full_state_dict()
            seen["steps"] = trainer.engine.global_steps
            seen["lr"] = [g["lr"] for g in trainer.engine.optimizer.param_groups]

    trainer = ZeroTrainer(model=llama(seed=5), train_dataset=token_data(),
                          args=training_args(root / "one"), zero_options={"stage": 1},
                          callbacks=[AtTrainBegin()])
    trainer.train(resume_from_checkpoint=str(folder))
    saved = consolidate(folder / "zero_checkpoint")
    assert seen["steps"] == 3 and trainer.state.global_step == 6
    assert seen["lr"] == [g["lr"] for g in saved["optimizer"]["param_groups"]]
    for key, value in saved["model"].items():
        assert torch.equal(seen["state"][key], value), key
    assert all(torch.isfinite(torch.tensor(x)) for x in logged(trainer, "loss"))
    trainer.engine.close()
