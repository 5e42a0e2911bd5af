"""PPOTrainer on 2 ranks whose batches differ so that one does not split
into the engines' micro-batches (gradient_accumulation_steps=2: 4 prompts
on rank 0, 3 on rank 1): refused on both ranks before anything is
generated. Before, rank 1 raised in its training after generating and
scoring, alone, and rank 0 waited in its next collective (a job that
caught the error hung)."""
import torch

import harness
import ppo_reference as ref


def _worker(rank, world):
    import zero
    from zero.rlhf import PPOSettings, PPOTrainer, ScalarHeadModel
    cfg = ref.case_config("stage 0")
    actor_model, reference_model, (reward_body, _), (critic_body, _) = ref.build_models(cfg)
    options = dict(gradient_accumulation_steps=2, stage=2)
    actor = zero.initialize(actor_model, optimizer=torch.optim.SGD(
        actor_model.parameters(), lr=0.1), **options)
    critic_model = ScalarHeadModel(critic_body, ref.HIDDEN)
    critic = zero.initialize(critic_model, optimizer=torch.optim.SGD(
        critic_model.parameters(), lr=0.1), **options)
    ppo = PPOTrainer(actor, critic, reference_model, ScalarHeadModel(reward_body, ref.HIDDEN),
                     PPOSettings(response_length=3), pad_token_id=0)
    prompts = ref.prompts_for(cfg, rank, 0)[:4 if rank == 0 else 3]
    try:
        ppo.step(prompts)
        out = "trained"
    except ValueError as error:
        out = str(error)
    # both ranks still pair their collectives: a good batch trains
    stats = ppo.step(ref.prompts_for(cfg, rank, 1)[:4])
    for engine in (actor, critic):
        engine.close()
    return out, float(stats["actor_loss"])


def test_a_batch_one_rank_cannot_split_is_refused_on_every_rank_first():
    (first, loss0), (second, loss1) = harness.run(2, _worker, timeout=240)
    assert first == "PPO: another rank's batch was refused (its error says why); no rank " \
                    "generates"
    assert second == ("PPO: a batch of 3 prompts does not split into the actor's "
                      "gradient_accumulation_steps=2 micro-batches")
    assert loss0 == loss0 and loss1 == loss1  # numbers: the next iteration ran on both
