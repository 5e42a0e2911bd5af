"""HuggingFace architectures whose structure differs from GPT-2's and
Llama's (tests/test_hf_llama.py), each built tiny from a config, trained
under stages 2 and 3 (every unit released) in one process against a deep
copy trained by plain torch:

- T5: encoder-decoder, embeddings shared by both stacks and the head,
  relative position bias computed by the first layer and passed on;
- ALBERT: one layer's weights reused at every depth (a module run several
  times a pass);
- Mixtral: a mixture of experts whose experts run only for the tokens
  routed to them (modules skipped or run depending on the data);
- Whisper: a convolutional front end over audio features, encoder-decoder;
- BLOOM: ALiBi position biases, fused query-key-value.

Dropout is off (eval mode) so both sides compute the same forward. Each
loss within 1e-5 of the twin's; every final weight within 1e-6 of the
twin's, absolutely: the forward and backward are the same ops and the
updates differ by ulps (at most 1.2e-7 measured after 3 AdamW steps),
while a gradient lost or sent to the wrong place moves elements by about
the learning rate (1e-3) a step. Absolute, not relative to each tensor:
some elements' gradients are zero in exact arithmetic (attention key
biases, which softmax ignores), so rounding alone steers their Adam
updates, and a zero-initialised bias is as small as those updates."""
import copy

import pytest
import torch
import transformers

import zero
from hf_cases import one_process  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_process")
V = 96  # vocabulary


def _tokens(g, rows=2, length=12):
    return torch.randint(0, V, (rows, length), generator=g)


def _causal(g):
    ids = _tokens(g)
    return dict(input_ids=ids, labels=ids)


def _seq2seq(g):
    return dict(input_ids=_tokens(g), labels=_tokens(g, length=8))


def _speech(g):
    return dict(input_features=torch.randn(2, 16, 60, generator=g),
                labels=torch.randint(3, V, (2, 6), generator=g))


MODELS = {
    "t5": (lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0)), _seq2seq),
    "albert": (lambda: transformers.AlbertForMaskedLM(transformers.AlbertConfig(
        vocab_size=V, embedding_size=16, hidden_size=32, num_hidden_layers=3,
        num_attention_heads=4, intermediate_size=64)), _causal),
    "mixtral": (lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2)), _causal),
    "whisper": (lambda: transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
        max_source_positions=30, max_target_positions=20, decoder_start_token_id=1,
        pad_token_id=0, eos_token_id=2, bos_token_id=1)), _speech),
    "bloom": (lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=V, hidden_size=32, n_layer=2, n_head=4)), _causal),
}


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_architecture_trains_as_in_torch(name, stage):
    build, batch = MODELS[name]
    torch.manual_seed(0)
    model = build().eval()
    ref = copy.deepcopy(model)
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                             stage=stage, gradient_clipping=1.0,
                             stage3_param_persistence_threshold=0)
    try:
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            inputs = batch(g)
            loss = engine(**inputs).loss
            engine.backward(loss)
            engine.step()
            ref_loss = ref(**inputs).loss
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            ref_opt.step()
            ref_opt.zero_grad()
            assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item()), step
        full = engine.full_state_dict()
    finally:
        engine.close()
    for key, value in ref.state_dict().items():
        if value.is_floating_point():
            error = float((full[key].double() - value.double()).abs().max())
            assert error <= 1e-6, (key, error)
