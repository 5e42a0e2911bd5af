"""tests/test_module_backward_hooks.py on 2 gloo ranks: the gathers a
module's backward hook needs are collectives, issued by every rank in
autograd's order. Each rank trains on the same batches, so the result
must equal one process's plain torch run."""
import pytest

import harness
from test_module_backward_hooks import assert_matches, torch_run, zero_run


def _on_rank(rank, world, kind, units):
    state, losses, _model = zero_run(kind, units)
    return state, losses


@pytest.mark.parametrize("kind", ["full", "pre"])
def test_backward_hooks_read_gathered_weights_on_two_ranks(kind):
    reference = torch_run(kind, "block")
    results = harness.run(2, _on_rank, kind, "block")
    for state, _losses in results:
        assert_matches(state, reference)
    assert results[0][1] == results[1][1]
