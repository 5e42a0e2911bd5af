"""DeepSpeed-Chat's three RLHF steps on zero (zero.rlhf), on a synthetic
preference task small enough for a CPU: tiny GPT-2 models built from a
config, prompts of random tokens, and a known preference: a response that
contains the target token is better than one that does not.

1. SFT: the actor learns to continue prompts with responses of random
   tokens (the target among them about one response in four);
2. reward model: a scalar head on a GPT-2 trained on (chosen, rejected)
   pairs that differ in holding the target; its pairwise accuracy on new
   pairs is printed;
3. PPO: the actor (from step 1) and the critic (from the reward model)
   train under zero at --stage; the reference (the SFT actor) and the
   reward model run frozen under zero.inference (stage 3, partitioned);
   the actor samples through the hybrid engine. Printed each iteration:
   the reward model's mean score, the true reward (the fraction of
   responses holding the target), the KL to the reference, and the time
   split of generation, scoring and training.

    python examples/rlhf/train.py                              # one process
    torchrun --nproc_per_node 2 examples/rlhf/train.py         # two (make rlhf)
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch

import zero
from zero.rlhf import PPOSettings, PPOTrainer, ScalarHeadModel, reward_loss, sft_loss

VOCAB, TARGET, PAD = 16, 1, 0
PROMPT, RESPONSE = 4, 4


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=PROMPT + RESPONSE,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
        eos_token_id=None, pad_token_id=PAD))


class Task:
    """Prompts and responses of random tokens; `with_target` True: one
    position holds the target, False: none does, None: any token of the
    vocabulary but padding (the SFT data)."""

    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def prompts(self, n):
        return torch.randint(2, VOCAB, (n, PROMPT), generator=self.g)

    def responses(self, n, with_target=None):
        if with_target is None:
            return torch.randint(1, VOCAB, (n, RESPONSE), generator=self.g)
        r = torch.randint(2, VOCAB, (n, RESPONSE), generator=self.g)
        if with_target:
            r[torch.arange(n), torch.randint(0, RESPONSE, (n,), generator=self.g)] = TARGET
        return r

    def pairs(self, n):
        p = self.prompts(n)
        return (torch.cat([p, self.responses(n, True)], 1),
                torch.cat([p, self.responses(n, False)], 1))


def true_reward(sequences):
    return float((sequences[:, PROMPT:] == TARGET).any(dim=1).float().mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=3, help="ZeRO stage of the trained models")
    ap.add_argument("--sft-steps", type=int, default=60)
    ap.add_argument("--rm-steps", type=int, default=80)
    ap.add_argument("--ppo-iterations", type=int, default=25)
    ap.add_argument("--batch", type=int, default=16, help="prompts a rank per step")
    ap.add_argument("--json", help="write the curves here (rank 0)")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    task = Task(seed=100 + rank)  # each rank its own data
    torch.manual_seed(0)  # the same initial weights on every rank
    log = print if rank == 0 else (lambda *a, **k: None)

    # 1. supervised fine-tuning
    actor_model = tiny_gpt2()
    engine = zero.initialize(actor_model, stage=args.stage,
                             optimizer=torch.optim.AdamW(actor_model.parameters(), lr=3e-3))
    sft = []
    for _ in range(args.sft_steps):
        ids = torch.cat([task.prompts(args.batch), task.responses(args.batch)], dim=1)
        loss = sft_loss(engine, ids, PROMPT)
        engine.backward(loss)
        engine.step()
        sft.append(float(loss.detach()))
    engine.close()
    log(f"1. SFT: loss {sft[0]:.3f} -> {sft[-1]:.3f}")

    # 2. the reward model
    rm_model = ScalarHeadModel.from_causal_lm(tiny_gpt2())
    engine = zero.initialize(rm_model, stage=args.stage,
                             optimizer=torch.optim.AdamW(rm_model.parameters(), lr=1e-3))
    for _ in range(args.rm_steps):
        loss, _accuracy = reward_loss(engine, *task.pairs(args.batch))
        engine.backward(loss)
        engine.step()
    with torch.no_grad():
        _loss, accuracy = reward_loss(engine, *Task(seed=999).pairs(256))
    engine.close()
    log(f"2. reward model: pairwise accuracy {accuracy:.3f} on 256 new pairs")

    # 3. PPO
    critic_model = copy.deepcopy(rm_model)  # the critic starts as the reward model
    reference = zero.inference(copy.deepcopy(actor_model), stage=3)
    reward = zero.inference(rm_model, stage=3)
    actor = zero.initialize(actor_model, stage=args.stage,
                            optimizer=torch.optim.AdamW(actor_model.parameters(), lr=1e-3))
    critic = zero.initialize(critic_model, stage=args.stage,
                             optimizer=torch.optim.AdamW(critic_model.parameters(), lr=1e-3))
    ppo = PPOTrainer(actor, critic, reference, reward,
                     PPOSettings(response_length=RESPONSE, kl_coef=0.02, ppo_epochs=2),
                     pad_token_id=PAD)
    torch.manual_seed(1 + rank)  # each rank samples its own responses
    curve = []
    log("3. PPO   score   true reward   KL     generation s  scoring s  training s")
    for iteration in range(args.ppo_iterations):
        stats = ppo.step(task.prompts(args.batch * 2))
        row = {"iteration": iteration, "score": stats["score"],
               "true_reward": true_reward(stats["sequences"]), "kl": stats["kl"],
               "generation_s": stats["generation_s"], "scoring_s": stats["scoring_s"],
               "training_s": stats["training_s"]}
        curve.append(row)
        log(f"   {iteration:4d}  {row['score']:6.2f}  {row['true_reward']:11.2f}  "
            f"{row['kl']:6.3f}  {row['generation_s']:12.3f}  {row['scoring_s']:9.3f}  "
            f"{row['training_s']:10.3f}")
    for engine in (actor, critic, reference, reward):
        engine.close()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"sft_loss": sft, "rm_accuracy": accuracy, "ppo": curve}, f, indent=1)
    return curve


if __name__ == "__main__":
    start = time.time()
    main()
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"done in {time.time() - start:.1f} s")
