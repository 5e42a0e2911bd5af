"""A HuggingFace Llama (built from a config, no download: grouped-query
attention, rotary buffers, tied embeddings) trained under every stage in
one process, against the same model trained by plain torch with clipping.
Tolerance 1e-5 normwise after 3 AdamW steps: the forward and backward are
the same ops; the updates differ by ulps (measured 2.6e-6)."""
import copy

import pytest
import torch
import transformers

import zero
from conftest import max_rel_error
from hf_cases import one_process, train_side_by_side  # noqa: F401 (fixture)


pytestmark = pytest.mark.usefixtures("one_process")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_llama_trains_as_in_torch(stage):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ref = copy.deepcopy(model)
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                             stage=stage, gradient_clipping=1.0,
                             stage3_param_persistence_threshold=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    train_side_by_side(engine, ref, ref_opt, clip=1.0)
    full = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        assert max_rel_error(full[name], value) <= 1e-5, name
    engine.close()
