"""An independent reference for zero.rlhf.PPOTrainer.step: whole PPO
iterations written in plain torch from docs/rlhf.md ("PPO") and [Note:
one PPO iteration] in python/zero/rlhf/_ppo.py, against which
test_ppo_reference.py compares zero's engines.

Sampling: the reference is given the sequences zero generated (what
PPOTrainer.step returns as "sequences"), rebuilds their attention mask
itself (the prompt, then the response up to and with its first eos), and
computes everything else on its own: it imports nothing from zero.rlhf,
calls the GPT-2 bodies and scalar heads directly and steps torch.optim's
AdamW with the same settings.

Ranks: each rank samples its own prompts. The reference is the whole
batch as one: advantages whitened over every rank's valid tokens, and the
gradient the mean over (rank, micro-batch) of each micro-batch's masked
mean loss, as zero's engines average (docs/engine.md, "Averaging").
"""
from __future__ import annotations

import copy

import torch

PROMPT = 4
HIDDEN = 32

# name: how one comparison differs from DEFAULTS
CASES = {
    "stage 0": dict(stage=0, world=1),
    "stage 3": dict(stage=3, world=1),
    "stage 0, eos, accumulation 2, ema": dict(stage=0, world=1, eos=3, gas=2, ema=0.9),
    "stage 3, eos, accumulation 2, ema": dict(stage=3, world=1, eos=3, gas=2, ema=0.9),
    # dropout: scoring must run in eval mode; the training's dropout masks
    # are made equal by seeding torch before each side's training
    "stage 0, dropout": dict(stage=0, world=1, dropout=0.1),
    "stage 3, 2 ranks": dict(stage=3, world=2),
    "stage 3, 2 ranks, eos, accumulation 2, ema": dict(stage=3, world=2, eos=3, gas=2,
                                                       ema=0.9),
}
DEFAULTS = dict(eos=None, gas=1, ema=None, dropout=0.0, vocab=12, response=6, batch=8,
                iterations=2, lr=1e-3, ppo=dict(kl_coef=0.1, gamma=0.95, lam=0.9,
                                                clip_policy=0.05, clip_value=0.2,
                                                clip_reward=0.3, ppo_epochs=2,
                                                temperature=1.0))


def case_config(name):
    cfg = copy.deepcopy(DEFAULTS)
    cfg.update(CASES[name])
    return cfg


def build_models(cfg, seed=0):
    """The four models, the same on every call: the actor (a GPT-2 LM), the
    reference (the actor's weights moved a little, so the KL is not 0), and
    the reward model and critic as (GPT-2 body, scalar head) pairs of their
    own weights."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model
    torch.manual_seed(seed)
    d = cfg["dropout"]
    conf = GPT2Config(vocab_size=cfg["vocab"], n_embd=HIDDEN, n_layer=2, n_head=4,
                      n_positions=PROMPT + cfg["response"], resid_pdrop=d, embd_pdrop=d,
                      attn_pdrop=d, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    actor = GPT2LMHeadModel(conf)
    reference = copy.deepcopy(actor)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))

    def scalar():
        body = GPT2Model(conf)
        head = torch.nn.Linear(HIDDEN, 1, bias=False)
        torch.nn.init.normal_(head.weight, std=0.5)
        return body, head
    return actor, reference, scalar(), scalar()


def prompts_for(cfg, rank, iteration):
    g = torch.Generator().manual_seed(1000 * rank + iteration)
    low = 1 if cfg["eos"] is None else cfg["eos"] + 1  # no eos inside a prompt
    return torch.randint(low, cfg["vocab"], (cfg["batch"], PROMPT), generator=g)


# ---- zero's side ---------------------------------------------------------------

def run_zero(rank, world, name) -> list:
    """zero's PPO on this rank, per iteration: the sequences, the stats,
    the actor's and critic's full_state_dict and the EMA."""
    import zero
    from zero.rlhf import PPOSettings, PPOTrainer, ScalarHeadModel
    cfg = case_config(name)
    actor_model, reference_model, (reward_body, reward_head), (critic_body, critic_head) = \
        build_models(cfg)
    reward_model = ScalarHeadModel(reward_body, HIDDEN)
    critic_model = ScalarHeadModel(critic_body, HIDDEN)
    with torch.no_grad():
        reward_model.head.weight.copy_(reward_head.weight)
        critic_model.head.weight.copy_(critic_head.weight)
    options = dict(gradient_accumulation_steps=cfg["gas"], stage=cfg["stage"])
    if cfg["stage"] == 3:
        options["stage3_param_persistence_threshold"] = 0  # every unit released
    actor = zero.initialize(actor_model, optimizer=torch.optim.AdamW(
        actor_model.parameters(), lr=cfg["lr"]), **options)
    critic = zero.initialize(critic_model, optimizer=torch.optim.AdamW(
        critic_model.parameters(), lr=cfg["lr"]), **options)
    reference = zero.inference(reference_model, stage=3)
    reward = zero.inference(reward_model, stage=3)
    ppo = PPOTrainer(actor, critic, reference, reward,
                     PPOSettings(response_length=cfg["response"], ema=cfg["ema"], **cfg["ppo"]),
                     pad_token_id=0, eos_token_id=cfg["eos"])
    record = []
    for it in range(cfg["iterations"]):
        torch.manual_seed(77 + 10 * it + rank)  # the sampling
        experience = ppo.make_experience(prompts_for(cfg, rank, it))
        if cfg["dropout"]:
            torch.manual_seed(5000 + 100 * it)  # the training's dropout masks
        stats = ppo.train(experience)
        entry = {"sequences": experience["sequences"].clone(),
                 "stats": {"actor_loss": float(stats["actor_loss"]),
                           "critic_loss": float(stats["critic_loss"]),
                           "score": float(experience["scores"].mean()),
                           "kl": float(experience["kl"])},
                 "actor": actor.full_state_dict(), "critic": critic.full_state_dict()}
        if cfg["ema"] is not None:
            entry["ema"] = {k: v.clone() for k, v in ppo.ema_state.items()}
        record.append(entry)
    for engine in (actor, critic, reference, reward):
        engine.close()
    return record


# ---- the reference -------------------------------------------------------------

def response_mask(sequences, eos):
    """1 on each response token up to and with the first eos."""
    response = sequences[:, PROMPT:]
    mask = torch.ones(response.shape, dtype=torch.long)
    if eos is not None:
        for i in range(response.shape[0]):
            hits = (response[i] == eos).nonzero()
            if len(hits):
                mask[i, int(hits[0]) + 1:] = 0
    return mask


def logprobs_of(lm, sequences, attention):
    logits = lm(input_ids=sequences, attention_mask=attention).logits.float()
    logp = torch.log_softmax(logits[:, PROMPT - 1:-1], dim=-1)
    return logp.gather(-1, sequences[:, PROMPT:, None])[..., 0]


def scalars_of(model, sequences, attention):
    body, head = model
    hidden = body(input_ids=sequences, attention_mask=attention).last_hidden_state
    return head(hidden)[..., 0].float()


def experience_of(models, cfg, sequences):
    """One rank's sequences scored; the advantages not yet whitened."""
    actor, reference, reward, critic = models
    s = cfg["ppo"]
    rmask = response_mask(sequences, cfg["eos"])
    attention = torch.cat([torch.ones(len(sequences), PROMPT, dtype=torch.long), rmask], 1)
    with torch.no_grad():
        lp = logprobs_of(actor, sequences, attention)
        ref_lp = logprobs_of(reference, sequences, attention)
        values = scalars_of(critic, sequences, attention)[:, PROMPT - 1:-1]
        rm = scalars_of(reward, sequences, attention)
    rows, length = rmask.shape
    lengths = rmask.sum(1)
    scores = torch.stack([rm[i, PROMPT + int(lengths[i]) - 1] for i in range(rows)])
    advantages = torch.zeros(rows, length)
    for i in range(rows):  # GAE written out, token by token
        n = int(lengths[i])
        r = [-s["kl_coef"] * float(lp[i, t] - ref_lp[i, t]) for t in range(n)]
        r[n - 1] += max(-s["clip_reward"], min(s["clip_reward"], float(scores[i])))
        v = [float(values[i, t]) for t in range(n)] + [0.0]
        running = 0.0
        for t in reversed(range(n)):
            running = r[t] + s["gamma"] * v[t + 1] - v[t] + s["gamma"] * s["lam"] * running
            advantages[i, t] = running
    m = rmask.float()
    return {"sequences": sequences, "attention": attention, "mask": m, "logprobs": lp,
            "values": values, "advantages": advantages, "returns": (advantages + values) * m,
            "scores": scores, "kl": float(((lp - ref_lp) * m).sum() / m.sum())}


def whiten_together(experiences):
    """Every rank's advantages whitened over all their valid tokens at
    once: population variance, 1e-8 in the root."""
    a = torch.cat([e["advantages"][e["mask"].bool()] for e in experiences]).double()
    mean, var = a.mean(), ((a - a.mean()) ** 2).mean()
    for e in experiences:
        e["advantages"] = (((e["advantages"].double() - mean) / torch.sqrt(var + 1e-8))
                           .float() * e["mask"])


def micro_batches(experience, k):
    size = len(experience["sequences"]) // k
    for j in range(k):
        part = slice(j * size, (j + 1) * size)
        yield {key: (v[part] if torch.is_tensor(v) and v.dim() > 0 else v)
               for key, v in experience.items()}


def actor_loss_of(actor, mb, clip, clipped):
    lp = logprobs_of(actor, mb["sequences"], mb["attention"])
    ratio = torch.exp(lp - mb["logprobs"])
    a = mb["advantages"]
    per_token = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip, 1 + clip))
    clipped["actor"] += int(((((ratio - 1).abs() > clip).float()) * mb["mask"]).sum())
    return (per_token * mb["mask"]).sum() / mb["mask"].sum()


def critic_loss_of(critic, mb, clip, clipped):
    v = scalars_of(critic, mb["sequences"], mb["attention"])[:, PROMPT - 1:-1]
    old, returns = mb["values"], mb["returns"]
    v_clipped = torch.clamp(v, old - clip, old + clip)
    per_token = 0.5 * torch.maximum((v - returns) ** 2, (v_clipped - returns) ** 2)
    clipped["critic"] += int(((((v - old).abs() > clip).float()) * mb["mask"]).sum())
    return (per_token * mb["mask"]).sum() / mb["mask"].sum()


class Reference:
    """The four models unsharded in this process, stepping by hand."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.actor, self.reference, reward, critic = build_models(cfg)
        self.reward, self.critic = torch.nn.ModuleList(reward), torch.nn.ModuleList(critic)
        for m in (self.reference, self.reward):
            m.requires_grad_(False)
        self.actor_opt = torch.optim.AdamW(self.actor.parameters(), lr=cfg["lr"])
        self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=cfg["lr"])
        # DeepSpeed-Chat's EMA: a copy of the actor before PPO, then after each
        # iteration decay * ema + (1 - decay) * weights
        self.ema = None if cfg["ema"] is None else \
            {n: v.detach().clone() for n, v in self.actor.state_dict().items()}
        self.iterations = 0
        self.clipped = {"actor": 0, "critic": 0}  # tokens the clips acted on

    def iteration(self, sequences_per_rank) -> list:
        """One iteration over every rank's sequences; each rank's stats."""
        cfg, s = self.cfg, self.cfg["ppo"]
        for m in (self.actor, self.reference, self.reward, self.critic):
            m.eval()
        models = (self.actor, self.reference, tuple(self.reward), tuple(self.critic))
        experiences = [experience_of(models, cfg, seq) for seq in sequences_per_rank]
        whiten_together(experiences)
        self.actor.train()
        self.critic.train()
        if cfg["dropout"]:  # zero's side seeds the same before its training
            torch.manual_seed(5000 + 100 * self.iterations)
        self.iterations += 1
        ranks, k = len(experiences), cfg["gas"]
        losses = {"actor": [[] for _ in experiences], "critic": [[] for _ in experiences]}
        for _ in range(s["ppo_epochs"]):
            for side, model, opt, loss_of, clip in (
                    ("actor", self.actor, self.actor_opt, actor_loss_of, s["clip_policy"]),
                    ("critic", self.critic, self.critic_opt, critic_loss_of, s["clip_value"])):
                opt.zero_grad()
                for r, experience in enumerate(experiences):
                    for mb in micro_batches(experience, k):
                        loss = loss_of(model, mb, clip, self.clipped)
                        (loss / (k * ranks)).backward()
                        losses[side][r].append(float(loss.detach()))
                opt.step()
        if cfg["ema"] is not None:
            for n, v in self.actor.state_dict().items():
                self.ema[n].mul_(cfg["ema"]).add_(v, alpha=1 - cfg["ema"])
        return [{"actor_loss": sum(a) / len(a), "critic_loss": sum(c) / len(c),
                 "score": float(e["scores"].mean()), "kl": e["kl"]}
                for a, c, e in zip(losses["actor"], losses["critic"], experiences)]

    def critic_state(self):
        """The critic's weights under ScalarHeadModel's names."""
        state = {"backbone." + n: v for n, v in self.critic[0].state_dict().items()}
        state["head.weight"] = self.critic[1].weight.detach()
        return state


# ---- the comparison ------------------------------------------------------------

def relative(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def key_bias(name) -> bool:
    return name.endswith("attn.c_attn.bias")


def worst_relative(ours, theirs) -> float:
    """The largest ||ours - theirs|| / ||theirs|| over the tensors. The
    key bias (the middle third of c_attn's bias) is left out here: its
    gradient is 0 in exact arithmetic (softmax ignores q.b_k, the same for
    every key), so each side's is rounding noise of ~1e-9 that Adam turns
    into updates of up to lr either way; key_bias_apart bounds it."""
    worst = 0.0
    for name, v in theirs.items():
        if not v.is_floating_point() or name.endswith(("attn.bias", "masked_bias")):
            continue
        mine = ours[name]
        if key_bias(name):
            mine, v = mine.clone(), v.clone()
            mine[HIDDEN:2 * HIDDEN] = 0
            v[HIDDEN:2 * HIDDEN] = 0
        worst = max(worst, relative(mine, v))
    return worst


def key_bias_apart(ours, theirs) -> float:
    return max(float((ours[n][HIDDEN:2 * HIDDEN] - v[HIDDEN:2 * HIDDEN]).abs().max())
               for n, v in theirs.items() if key_bias(n))


def compare(records, name) -> list:
    """Per iteration, zero's (every rank's `records`) against the
    reference's: the worst relative differences of the weights and stats,
    the key bias's largest absolute difference, whether the ranks agree,
    and how many tokens the clips acted on and rows ended early."""
    cfg = case_config(name)
    reference = Reference(cfg)
    rows = []
    for it in range(cfg["iterations"]):
        sequences = [record[it]["sequences"] for record in records]
        theirs = reference.iteration(sequences)
        ours = records[0][it]
        actor, critic = reference.actor.state_dict(), reference.critic_state()
        row = {"actor": worst_relative(ours["actor"], actor),
               "critic": worst_relative(ours["critic"], critic),
               "key_bias": max(key_bias_apart(ours["actor"], actor),
                               key_bias_apart(ours["critic"], critic)),
               # |zero - ref| / max(|ref|, 1e-2): the KL (~1e-3) is a difference
               # of close numbers
               "stats": max(abs(record[it]["stats"][k] - v) / max(abs(v), 1e-2)
                            for record, stats in zip(records, theirs)
                            for k, v in stats.items()),
               "ranks_agree": all(torch.equal(record[it][side][n], ours[side][n])
                                  for record in records[1:] for side in ("actor", "critic")
                                  for n in ours[side]),
               "clipped": dict(reference.clipped)}
        if cfg["ema"] is not None:
            row["ema"] = worst_relative(ours["ema"], reference.ema)
        masks = torch.cat([response_mask(s, cfg["eos"]) for s in sequences])
        row["ended_early"] = int((masks.sum(1) < masks.shape[1]).sum())
        row["rows"] = len(masks)
        rows.append(row)
    return rows
