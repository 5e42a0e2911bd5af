"""Seq2SeqTrainer's predict_with_generate through ZeroTrainerMixin at
stage 3 on 2 gloo ranks, where the ranks' batches end generating at other
steps (a logits processor ends rank 0's at its first token): every
generated token's forward gathers with collectives, so the rank that
stopped first left the other gathering alone, and gloo aborted. The mixin
gathers the model whole for each batch where it fits (no collective while
generating; without a cache too, where HF's synced loop fails), and
otherwise generates unit by unit with synced_gpus on; the predictions
equal the plain Seq2SeqTrainer's under DDP either way."""
import pytest

import harness

pytest.importorskip("transformers", reason="requirements-test.txt installs transformers")

VOCAB = 32
EOS = 1


def _t5():
    import torch
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=EOS))


def _rows(count=12, seed=9):
    import torch
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        ids = torch.randint(2, VOCAB, (16,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                     "labels": ids[:6].flip(0).clone()})
    return rows


def _ending_on_rank_0():
    """A logits processor that ends every sequence of rank 0 at its first
    token (eos forced) while rank 1's run to max_new_tokens: the ranks'
    generations end at other steps, as batches whose sequences reach eos at
    different lengths do."""
    import torch
    import torch.distributed as dist
    from transformers import LogitsProcessor, LogitsProcessorList

    class EndsOnRank0(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if dist.get_rank() == 0:
                scores = torch.full_like(scores, -float("inf"))
                scores[:, EOS] = 0.0
            return scores
    return LogitsProcessorList([EndsOnRank0()])


def _predictions(rank, world, directory, gather, use_cache):
    import numpy as np
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
    import zero.engine._generation as generation
    from zero.integrations.hf import ZeroTrainerMixin
    if gather == "units":  # the whole model does not fit gathered (as far as it knows)
        generation.available_memory = lambda device: 0

    class ZeroSeq2SeqTrainer(ZeroTrainerMixin, Seq2SeqTrainer):
        pass

    def arguments(name):
        return Seq2SeqTrainingArguments(
            output_dir=f"{directory}/{name}", predict_with_generate=True,
            per_device_eval_batch_size=3, report_to=[], use_cpu=True, disable_tqdm=True,
            dataloader_num_workers=0, save_strategy="no", ddp_timeout=120)
    rows = _rows()
    generation = {"max_new_tokens": 12, "logits_processor": _ending_on_rank_0(),
                  "use_cache": use_cache}
    plain = Seq2SeqTrainer(model=_t5(), args=arguments("plain"))
    expected = plain.predict(rows, **generation).predictions
    model = _t5()
    ours = ZeroSeq2SeqTrainer(model=model, args=arguments("zero"), train_dataset=rows,
                              zero_options={"stage": 3, "stage3_param_persistence_threshold": 0})
    ours.create_optimizer()  # the engine, as train() makes it
    got = ours.predict(rows, **generation).predictions
    ours.engine.close()
    return bool(np.array_equal(expected, got)), got.shape


@pytest.mark.parametrize("gather,use_cache", [("whole", True), ("whole", False),
                                               ("units", True)])
def test_generation_that_ends_apart_equals_the_plain_trainers(tmp_path, gather, use_cache):
    for same, shape in harness.run(2, _predictions, str(tmp_path), gather, use_cache,
                                   timeout=240):
        assert same and shape[0] == 12
