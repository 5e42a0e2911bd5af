"""What the ZeroTrainer tests share: a tiny Llama (tied embeddings, GQA),
a token data set made here, and TrainingArguments for a short run with
gradient accumulation, warm-up and a linear schedule, and clipping."""
import torch

VOCAB = 128


def llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def token_data(count=64, length=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def training_args(output_dir, batch=4, **overrides):
    from transformers import TrainingArguments
    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=batch,
                    gradient_accumulation_steps=2, max_steps=6, learning_rate=1e-3,
                    lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=0.5,
                    logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                    dataloader_num_workers=0, seed=0, disable_tqdm=True)
    settings.update(overrides)
    return TrainingArguments(**settings)


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def same_logged_loss(ours: float, ref: float) -> bool:
    """The Trainer logs losses rounded to 4 decimals: two losses within 1e-5
    may round 1e-4 apart."""
    return abs(ours - ref) <= 1.01e-4
