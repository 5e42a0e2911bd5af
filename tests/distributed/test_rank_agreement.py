"""zero.initialize on 2 gloo ranks that do not agree: each kind of
difference is refused on every rank, naming what differs, before any
collective could pair unrelated buffers (before the check, these trained
silently wrong, aborted inside gloo, or hung). Frozen parameters take
rank 0's values at every stage, as DDP's do."""
import torch
from torch import nn

import harness
import zero


def _model(rank, case):
    if case == "shape":
        hidden = 8 if rank == 0 else 9
        return nn.Sequential(nn.Linear(4, hidden), nn.Linear(hidden, 2))
    if case == "transposed":  # the same number of elements, another shape
        return nn.Linear(4, 6, bias=False) if rank == 0 else nn.Linear(6, 4, bias=False)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    if case == "frozen" and rank == 1:
        model[0].bias.requires_grad_(False)
    return model


def _initialize(rank, world, case):
    torch.manual_seed(0)
    model = _model(rank, case)
    lr = 0.1 if case == "lr" and rank == 1 else 0.01
    optimizer = torch.optim.SGD(model.parameters(), lr=lr) if case == "optimizer" and rank \
        else torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    options = {"stage": 2}
    if case == "stage":
        options["stage"] = rank
    if case == "clipping":
        options["gradient_clipping"] = 1.0 * rank
    if case == "accumulation":
        options["gradient_accumulation_steps"] = 1 + rank
    try:
        engine = zero.initialize(model, optimizer=optimizer, **options)
    except ValueError as error:
        return str(error)
    engine.close()
    return None


CASES = {"shape": "parameters", "transposed": "parameters", "frozen": "parameters",
         "lr": "optimizer", "optimizer": "optimizer", "stage": "settings",
         "clipping": "settings", "accumulation": "settings"}


def _all_cases(rank, world):
    return {case: _initialize(rank, world, case) for case in [*CASES, "same"]}


def _frozen_values(rank, world):
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(rank)  # every rank builds other values
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        model[0].requires_grad_(False)
        engine = zero.initialize(model, stage=stage)
        out[stage] = {k: v.clone() for k, v in engine.full_state_dict().items()}
        with zero.GatheredParameters(list(model.parameters())):
            out[stage]["live"] = model[0].weight.detach().clone()
        engine.close()
    return out


def test_ranks_that_differ_are_refused_on_every_rank():
    results = harness.run(2, _all_cases)
    for rank, result in enumerate(results):
        assert result["same"] is None
        for case, aspect in CASES.items():
            message = result[case]
            assert message is not None, f"{case} was not refused on rank {rank}"
            assert f"the ranks differ in their {aspect}" in message, (case, message)
            assert f"This rank ({rank}) has:" in message


def test_frozen_parameters_take_rank_zeros_values():
    rank0, rank1 = harness.run(2, _frozen_values)
    torch.manual_seed(0)
    expected = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))[0].weight.detach()
    for stage in (0, 1, 2, 3):
        for key in rank0[stage]:
            assert torch.equal(rank0[stage][key], rank1[stage][key]), (stage, key)
        assert torch.equal(rank1[stage]["live"], expected), stage
