"""HuggingFace generate() under stage 3 on 2 gloo ranks, with ranks that
stop at different steps (rank 0 wants 3 new tokens, rank 1 wants 9).

Every forward gathers parameters with collectives, so a rank that stops
early would leave the others waiting in a gather forever. generate(...,
synced_gpus=True) keeps a finished rank running dummy forward passes until
every rank is done: that is what the user (or an integration) must pass;
transformers turns it on by itself only for DeepSpeed ZeRO-3 and FSDP
(docs/engine.md). engine.generate needs neither: it gathers the model once
and runs no collective until it is done. The tokens must equal a plain
model's greedy output every way, and engine.generate(gather="units")
(unit by unit, for a model that does not fit gathered) sets synced_gpus
itself."""
import pytest
import torch

import harness

pytest.importorskip("transformers")

NEW_TOKENS = [3, 9]


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                     eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).eval()


def prompt(rank):
    return torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(rank))


def generate(rank, world):
    import zero
    model = tiny_gpt2()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             stage3_param_persistence_threshold=0)
    with torch.no_grad():
        out = engine.module.generate(prompt(rank), max_new_tokens=NEW_TOKENS[rank],
                                     do_sample=False, synced_gpus=True)
    # engine.generate gathers once and runs no collective until it ends:
    # no synced_gpus, each rank stops at its own length
    once = engine.generate(prompt(rank), max_new_tokens=NEW_TOKENS[rank], do_sample=False)
    # without a cache too: HF's generate, left to itself, syncs the ranks on
    # a model carrying FSDP's marks, and its synced loop without a cache
    # failed on the rank that finished first (a mask one longer than the ids)
    no_cache = engine.generate(prompt(rank), max_new_tokens=NEW_TOKENS[rank], do_sample=False,
                               use_cache=False)
    # unit by unit (a model that does not fit gathered): synced_gpus is set for the caller
    units = engine.generate(prompt(rank), max_new_tokens=NEW_TOKENS[rank], do_sample=False,
                            gather="units")
    engine.close()
    return out, once, no_cache, units


def test_generation_with_ranks_finishing_apart():
    results = harness.run(2, generate, timeout=180)
    model = tiny_gpt2()
    for rank, (out, once, no_cache, units) in enumerate(results):
        with torch.no_grad():
            expected = model.generate(prompt(rank), max_new_tokens=NEW_TOKENS[rank],
                                      do_sample=False)
        assert out.shape[1] == 5 + NEW_TOKENS[rank]
        assert torch.equal(out, expected), rank
        assert torch.equal(once, expected), rank
        assert torch.equal(units, expected), rank
        with torch.no_grad():
            expected = model.generate(prompt(rank), max_new_tokens=NEW_TOKENS[rank],
                                      do_sample=False, use_cache=False)
        assert torch.equal(no_cache, expected), rank


def tiny_lora_gpt2():
    import peft
    model = peft.get_peft_model(tiny_gpt2(), peft.LoraConfig(
        r=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0))
    return model.eval()


def generate_wrapped(rank, world):
    """A PEFT model's generate(*args, **kwargs) hands synced_gpus to HF's
    as well: engine.generate's default reaches it through the wrapper."""
    import zero
    model = tiny_lora_gpt2()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad]), stage=3,
        stage3_param_persistence_threshold=0)
    out = engine.generate(input_ids=prompt(rank), max_new_tokens=NEW_TOKENS[rank],
                          do_sample=False, use_cache=False)
    engine.close()
    return out


def test_generation_of_a_wrapped_model_with_ranks_finishing_apart():
    pytest.importorskip("peft")
    results = harness.run(2, generate_wrapped, timeout=180)
    model = tiny_lora_gpt2()
    for rank, out in enumerate(results):
        with torch.no_grad():
            expected = model.generate(input_ids=prompt(rank), max_new_tokens=NEW_TOKENS[rank],
                                      do_sample=False, use_cache=False)
        assert torch.equal(out, expected), rank


def tiny_draft():
    torch.manual_seed(5)  # other weights than the main model's
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64,
                                      n_positions=32, eos_token_id=None, bos_token_id=None,
                                      pad_token_id=0)).eval()


def generate_assisted(rank, world, main_stage, gather):
    """Assisted decoding with a stage-3 draft model (a zero.inference
    engine, given as it is): gathered whole whatever the main model's way,
    so ranks stop apart (its forwards gathered with collectives, and its
    own inner generate synced by itself: the longer rank waited for good,
    or gloo aborted). Unit by unit on several ranks it is refused: HF's
    synced loop fails with assisted decoding."""
    import zero
    model = tiny_gpt2()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()),
                             stage=main_stage, stage3_param_persistence_threshold=0)
    draft = zero.inference(tiny_draft(), stage=3, stage3_param_persistence_threshold=0)
    try:
        # (HF assists a batch of one)
        return engine.generate(prompt(rank)[:1], max_new_tokens=NEW_TOKENS[rank],
                               do_sample=False, assistant_model=draft, gather=gather)
    except ValueError as error:
        return str(error)
    finally:
        draft.close()
        engine.close()


@pytest.mark.parametrize("main_stage,gather", [(3, "whole"), (2, "auto"), (3, "units")])
def test_assisted_generation_with_a_stage_3_draft_and_ranks_finishing_apart(main_stage, gather):
    results = harness.run(2, generate_assisted, main_stage, gather, timeout=180)
    model, draft = tiny_gpt2(), tiny_draft()
    for rank, out in enumerate(results):
        if gather == "units":
            assert "unit by unit on several ranks" in out, out
            continue
        with torch.no_grad():
            expected = model.generate(prompt(rank)[:1], max_new_tokens=NEW_TOKENS[rank],
                                      do_sample=False, assistant_model=draft)
        assert torch.equal(out, expected), rank


def generate_other_ways(rank, world):
    import zero
    model = tiny_gpt2()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             stage3_param_persistence_threshold=0, timeout=60)
    try:
        engine.generate(prompt(rank), max_new_tokens=3, do_sample=False,
                        gather=["whole", "units"][rank])
    except RuntimeError as error:
        return str(error)
    finally:
        engine.close()
    return None


def test_ranks_that_generate_other_ways_are_refused_together():
    """gather= differing between ranks paired one's whole-model gather with
    the other's unit gathers (a wait for the timeout): refused on every
    rank by the call's agreement, which names it."""
    for rank, error in enumerate(harness.run(2, generate_other_ways, timeout=120)):
        assert error is not None and "not in the same engine call" in error, rank
        assert f"gather={['whole', 'units'][rank]!r}" in error, error


def models_own_generate(rank, world):
    """The model's own generate, as a HuggingFace user calls it: on every
    rank without synced_gpus, ranks stopping apart; then on rank 0 alone,
    while rank 1 goes on to full_state_dict()."""
    import copy
    import zero
    from zero.engine._generation import _ROUTED
    model = tiny_gpt2()
    engine = zero.initialize(model, optimizer=torch.optim.AdamW(model.parameters()), stage=3,
                             stage3_param_persistence_threshold=0, timeout=60)
    out = model.generate(prompt(rank), max_new_tokens=NEW_TOKENS[rank], do_sample=False)
    # a copy is a plain model: it generates alone, not through the engine
    # (routed, rank 0's call would meet rank 1's next engine call)
    with zero.GatheredParameters(list(model.parameters())):
        twin = copy.deepcopy(model)
    twin_out = twin.generate(prompt(rank), max_new_tokens=2, do_sample=False) \
        if rank == 0 else None
    try:
        if rank == 0:
            model.generate(prompt(rank), max_new_tokens=2, do_sample=False)
        else:
            engine.full_state_dict()
        error = None
    except RuntimeError as caught:
        error = str(caught)
    engine.close()
    routed_after_close = model in _ROUTED or "generate" in model.__dict__
    return out, twin_out, error, routed_after_close


def test_the_models_own_generate_goes_through_the_engine():
    """model.generate(...) at stage 3 ran HF's synced loop (an all-reduce a
    token on the default group, a gather a unit a token); on rank 0 alone
    it met rank 1's next engine call: gloo aborted on the sizes, or both
    waited out the timeout (an HF trainer hunt). It goes through
    engine.generate now: the tokens are a plain model's, the ranks stop
    apart, and rank 0 alone is refused on both ranks, by name. A copy made
    inside zero.GatheredParameters generates by itself (an attribute on the
    model would have been copied with it, and generated from the original
    engine's weights)."""
    results = harness.run(2, models_own_generate, timeout=180)
    model = tiny_gpt2()
    for rank, (out, twin_out, error, routed_after_close) in enumerate(results):
        with torch.no_grad():
            expected = model.generate(prompt(rank), max_new_tokens=NEW_TOKENS[rank],
                                      do_sample=False)
            if rank == 0:
                assert torch.equal(twin_out, model.generate(prompt(0), max_new_tokens=2,
                                                            do_sample=False))
        assert torch.equal(out, expected), rank
        assert error is not None and "not in the same engine call" in error, (rank, error)
        assert ("generate(gather='auto')" if rank == 0 else "full_state_dict()") in error
        assert not routed_after_close  # close() gives the class's generate back
