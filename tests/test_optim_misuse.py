"""zero.optim used the ways torch.optim allows between steps: the result is
torch.optim's (foreach=False), or an error that names the parameter.

Tolerance: fp32 over a few steps, normwise relative error (max_rel_error)
at most 1e-6. One step differs from torch's by a few ulps (~1e-7 relative:
the core orders some operations differently); five steps stay well under
1e-6, while each defect these tests catch is off by ~1e-2 or more (a step
lost, reverted or applied twice). 16-bit parameters compare with an fp32
torch run rounded to the dtype: one rounding, 2**-8 relative for bf16.
"""
import collections
import copy
import pickle

import pytest
import torch

import zero.optim as zo
from conftest import max_rel_error

TOL = 1e-6
SHAPES = [(7, 5), (33,), (3, 4, 2)]


def twins(seed=0, dtype=torch.float32, shapes=SHAPES):
    """Random parameters for zero.optim and equal ones for torch.optim."""
    g = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, theirs


def set_grads(params, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def pair(name, ours, theirs, **kw):
    return getattr(zo, name)(ours, **kw), getattr(torch.optim, name)(theirs, foreach=False, **kw)


def step_both(oz, ot, ours, theirs, seed):
    set_grads(ours, seed)
    set_grads(theirs, seed)
    oz.step()
    ot.step()


def assert_close(ours, theirs, tol=TOL):
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        assert max_rel_error(a, b) <= tol


# 1 ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_share_memory_after_build_steps_the_shared_storage(name):
    ours, theirs = twins(1)
    oz, ot = pair(name, ours, theirs, lr=0.1)
    step_both(oz, ot, ours, theirs, 0)
    for p in ours:
        p.share_memory_()  # what model.share_memory() does; frees the old block
        p.grad.share_memory_()
    reuse = [torch.full((1 << 12,), 7.0) for _ in range(8)]  # may take the freed blocks
    for s in range(1, 5):
        step_both(oz, ot, ours, theirs, s)
    assert all(p.is_shared() for p in ours)
    assert_close(ours, theirs)
    assert all(bool((t == 7.0).all()) for t in reuse)


# 2 ----------------------------------------------------------------------------

def test_zero_grad_keep_leaves_params_without_grad_alone():
    results = {}
    for mod in (zo, torch.optim):
        used, unused = twins(2, shapes=[(6,), (4,)])[0]
        frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
        kw = {} if mod is zo else {"foreach": False}
        opt = mod.AdamW([used, unused, frozen], lr=0.1, weight_decay=0.5, **kw)
        x = torch.randn(6, generator=torch.Generator().manual_seed(3))
        before = [unused.detach().clone(), frozen.detach().clone()]
        for _ in range(4):
            opt.zero_grad(set_to_none=False)
            (used * x).sum().backward()
            opt.step()
        assert unused.grad is None and frozen.grad is None
        assert torch.equal(unused, before[0]) and torch.equal(frozen, before[1])
        results[mod] = used.detach().clone()
    assert max_rel_error(results[zo], results[torch.optim]) <= TOL


# 3 ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pdata_replaced_by_equal_kind_is_stepped(dtype):
    ours, theirs = twins(4, dtype)
    oz, ot = pair("SGD", ours, theirs, lr=0.1, momentum=0.9)
    step_both(oz, ot, ours, theirs, 0)
    new = torch.randn(7, 5, generator=torch.Generator().manual_seed(5)).to(dtype)
    ours[0].data = new.clone()   # a re-initialisation after building
    theirs[0].data = new.clone()
    for s in range(1, 4):
        step_both(oz, ot, ours, theirs, s)
    if dtype == torch.float32:
        assert_close(ours, theirs)
    else:
        # torch steps in bf16 itself; ours in the fp32 master: a rounding per step
        assert_close(ours[:1], theirs[:1], tol=3 * 2.0 ** -8)
        assert max_rel_error(ours[0], new) > 1e-2  # it moved


@pytest.mark.parametrize("change", ["resize", "cast"])
def test_pdata_cast_or_resized_is_refused_by_name(change):
    model = torch.nn.Linear(4, 3)
    opt = zo.SGD(model.parameters(), lr=0.1)
    if change == "resize":
        model.bias.data = torch.zeros(5)
    else:
        model.to(torch.bfloat16)
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    with pytest.raises(RuntimeError, match=r"parameter \d of param group 0 .*new optimizer"):
        opt.step()


# 4 ----------------------------------------------------------------------------

def test_two_optimizers_over_one_parameter_both_step_as_torchs_do():
    """A notebook cell run again builds a second optimizer over the same
    parameters while the first is alive: each step takes the parameter back
    into its own buffer with its current values, so both updates apply."""
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(5))
    r = torch.nn.Parameter(p.detach().clone())
    first, second = zo.SGD([p], lr=0.1, momentum=0.9), zo.AdamW([p], lr=1e-2)
    ref_first = torch.optim.SGD([r], lr=0.1, momentum=0.9, foreach=False)
    ref_second = torch.optim.AdamW([r], lr=1e-2, foreach=False)
    for s in range(4):
        for opt, ref_opt in ((first, ref_first), (second, ref_second), (second, ref_second)):
            g = torch.randn(5, generator=torch.Generator().manual_seed(s))
            p.grad, r.grad = g.clone(), g.clone()
            opt.step()
            ref_opt.step()
    assert_close([p], [r], tol=1e-6)


@pytest.mark.parametrize("layout", ["one tensor twice", "overlapping views",
                                    "across groups", "added to a laid-out one"])
def test_parameters_that_share_memory_are_refused_by_name(layout):
    """torch.optim updates shared memory in place, so both parameters see
    both updates; laid out apart they trained on one each (-1 where torch
    gives -2), silently. Disjoint views of one tensor are taken."""
    base = torch.zeros(6)
    message = "parameter . of param group . and parameter . of param group . share memory"
    if layout == "added to a laid-out one":
        laid_out = torch.nn.Parameter(base)
        opt = zo.SGD([laid_out], lr=0.1)
        with pytest.raises(ValueError, match=message):
            opt.add_param_group({"params": [torch.nn.Parameter(laid_out.data[1:3])]})
        assert len(opt.param_groups) == 1
        return
    groups = {"one tensor twice": [[torch.nn.Parameter(base), torch.nn.Parameter(base)]],
              "overlapping views": [[torch.nn.Parameter(base[:4]), torch.nn.Parameter(base[3:])]],
              "across groups": [[torch.nn.Parameter(base[:4])], [torch.nn.Parameter(base[2:])]],
              }[layout]
    with pytest.raises(ValueError, match=message):
        zo.SGD([{"params": g} for g in groups], lr=0.1)
    disjoint = torch.zeros(6)
    a, b = torch.nn.Parameter(disjoint[:3]), torch.nn.Parameter(disjoint[3:])
    opt = zo.SGD([a, b], lr=1.0)
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    opt.step()
    assert a.tolist() == b.tolist() == [-1.0] * 3


def test_an_expanded_parameter_is_refused_by_name():
    """torch.optim refuses a stride-0 parameter at its step; laid out flat
    its elements trained apart (interop hunt)."""
    expanded = torch.nn.Parameter(torch.randn(4, 1).expand(4, 3))
    with pytest.raises(ValueError, match=r"parameter 1 of param group 0 has elements that "
                                         r"share memory \(an expanded tensor"):
        zo.AdamW([torch.nn.Parameter(torch.zeros(2)), expanded])


@pytest.mark.parametrize("name", ["SGD", "AdamW", "Adagrad", "Lion"])
def test_a_later_groups_bad_setting_leaves_the_step_unapplied(name):
    """A schedule that makes group 1's lr negative: the step refused only
    at group 1, after group 0 was updated and its step count advanced."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = getattr(zo, name)([{"params": [a]}, {"params": [b]}], lr=1.0)
    opt.param_groups[1]["lr"] = -0.1
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    with pytest.raises(ValueError, match="param group 1: lr must be a finite number >= 0, got "
                                         "-0.1; nothing was updated"):
        opt.step()
    assert a.tolist() == b.tolist() == [0.0, 0.0] and not opt.state[a].get("step")
    opt.param_groups[1]["lr"] = 0.1
    opt.step()
    assert a.tolist() != [0.0, 0.0] and b.tolist() != [0.0, 0.0]


def test_a_hyperparameter_that_is_not_a_number_is_refused_by_name():
    """float() took an lr of "0.01" (torch refuses it: a str cannot be
    compared with 0.0), at construction and when set between steps. A
    one-element tensor lr is taken, as torch takes it."""
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="lr is '0.01' \\(str\\); it must be a number"):
        zo.AdamW([p], lr="0.01")
    opt = zo.SGD([p], lr=torch.tensor(0.5))
    p.grad = torch.ones(2)
    opt.step()
    assert p.tolist() == [-0.5, -0.5]
    opt.param_groups[0]["momentum"] = "0.9"
    with pytest.raises(TypeError, match="param group 0: momentum is '0.9' .*nothing was updated"):
        opt.step()
    assert p.tolist() == [-0.5, -0.5]


@pytest.mark.parametrize("name", ["SGD", "AdamW", "Adagrad", "Lion"])
def test_differentiable_set_between_steps_is_refused(name):
    """Refused at construction, and now at the step too: set on a group
    afterwards, the step ran outside autograd as if it were False."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = getattr(zo, name)([p], lr=1.0)
    opt.param_groups[0]["differentiable"] = True
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="param group 0: differentiable=True: .*nothing was "
                                         "updated"):
        opt.step()
    assert p.tolist() == [0.0, 0.0] and not opt.state[p].get("step")


def test_copies_of_a_laid_out_parameter_are_free():
    model = torch.nn.Linear(3, 2)
    zo.SGD(model.parameters(), lr=1.0)
    twin = copy.deepcopy(model)
    zo.SGD(twin.parameters(), lr=1.0)
    pickle.loads(pickle.dumps(model))


# 5 ----------------------------------------------------------------------------

def test_16bit_weights_loaded_after_build_are_kept():
    torch.manual_seed(6)
    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    opt = zo.SGD(model.parameters(), lr=1e-2)
    pretrained = {k: torch.randn(v.shape).to(torch.bfloat16) for k, v in model.state_dict().items()}
    model.load_state_dict(pretrained)
    ref = [torch.nn.Parameter(pretrained[k].float()) for k in ("weight", "bias")]
    ref_opt = torch.optim.SGD(ref, lr=1e-2, foreach=False)
    for s in range(3):
        set_grads(list(model.parameters()), s)
        set_grads(ref, s)
        for r, p in zip(ref, model.parameters()):
            r.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    # the fp32 reference rounded once; without the take-in it is off by O(1)
    assert_close([p.float() for p in model.parameters()], ref, tol=2.0 ** -8)


def test_16bit_clamp_after_each_step_is_kept_and_spares_other_bits():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = zo.SGD([p], lr=0.3)
    for _ in range(5):
        p.grad = torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=torch.bfloat16)
        opt.step()
        master = opt.state[p]["master_param"].clone()
        with torch.no_grad():
            p.clamp_(max=1.0)
    p.grad = torch.zeros(4, dtype=torch.bfloat16)
    opt.step()
    # torch: 0.9 -> 1.2 -> clamp 1.0 -> 1.3 -> clamp 1.0 ...; the clamped
    # elements are 1.0 in the master, the others kept their fp32 values
    assert opt.state[p]["master_param"][:2].tolist() == [1.0, 1.0]
    assert torch.equal(opt.state[p]["master_param"][2:], master[2:])


# 6 ----------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["clear", "defaultdict", "replace"])
def test_state_reset_the_torch_way(how):
    ours, theirs = twins(7)
    oz, ot = pair("Adam", ours, theirs, lr=0.05)
    for s in range(3):
        step_both(oz, ot, ours, theirs, s)
    for opt, params in ((oz, ours), (ot, theirs)):
        if how == "clear":
            opt.state.clear()
        elif how == "defaultdict":
            opt.state = collections.defaultdict(dict)
        else:
            g = torch.Generator().manual_seed(8)
            for p in params:
                opt.state[p]["exp_avg"] = torch.randn(p.shape, generator=g)
                opt.state[p]["exp_avg_sq"] = torch.rand(p.shape, generator=g)
                opt.state[p]["step"] = torch.tensor(1.0)
    for s in range(3, 6):
        step_both(oz, ot, ours, theirs, s)
    assert_close(ours, theirs)
    assert [float(oz.state[p]["step"]) for p in ours] == [float(ot.state[p]["step"]) for p in theirs]


def test_replaced_state_of_another_shape_is_refused_by_name():
    ours, _ = twins(9)
    opt = zo.Adam(ours)
    opt.state[ours[1]]["exp_avg"] = torch.zeros(2)
    set_grads(ours, 0)
    with pytest.raises(ValueError, match=r"\['exp_avg'\] of parameter 1 of param group 0"):
        opt.step()


# 7 ----------------------------------------------------------------------------

def test_refused_param_group_is_not_kept():
    ours, theirs = twins(10)
    oz, ot = pair("SGD", ours[:1], theirs[:1], lr=0.1)
    bad = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="parameter 0 of param group 1 has dtype"):
        oz.add_param_group({"params": [bad], "lr": 100.0})
    assert len(oz.param_groups) == 1
    oz.add_param_group({"params": ours[1:], "lr": 0.003})
    ot.add_param_group({"params": theirs[1:], "lr": 0.003})
    for s in range(3):
        step_both(oz, ot, ours, theirs, s)
    assert_close(ours, theirs)


# 8 ----------------------------------------------------------------------------

def test_load_state_of_another_shape_is_refused_by_name():
    src = [torch.nn.Parameter(torch.randn(1, 5))]
    opt = zo.AdamW(src)
    set_grads(src, 0)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    dst = [torch.nn.Parameter(torch.randn(4, 5))]  # (1, 5) would broadcast
    target = zo.AdamW(dst)
    with pytest.raises(ValueError, match=r"\['exp_avg'\] of parameter 0 of param group 0 has "
                                         r"shape \(1, 5\), the parameter \(4, 5\)"):
        target.load_state_dict(sd)


# 9 ----------------------------------------------------------------------------

@pytest.mark.parametrize("change", ["append", "remove"])
def test_param_list_changed_directly_is_refused(change):
    a, b = twins(11, shapes=[(3,), (2,)])[0]
    opt = zo.SGD([a, b] if change == "remove" else [a], lr=1.0)
    if change == "append":
        opt.param_groups[0]["params"].append(torch.nn.Parameter(torch.zeros(2)))
    else:
        opt.param_groups[0]["params"].remove(a)
    a.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\] was changed"):
        opt.step()
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.state_dict()


# 10 ---------------------------------------------------------------------------

def test_sgd_momentum_switched_on_mid_run_starts_from_the_gradient():
    ours, theirs = twins(12)
    oz, ot = pair("SGD", ours, theirs, lr=0.1, dampening=0.3)
    for s in range(6):
        if s == 2:
            for o in (oz, ot):
                o.param_groups[0]["momentum"] = 0.9
        step_both(oz, ot, ours, theirs, s)
    assert_close(ours, theirs)


def test_sgd_state_dict_before_a_step_has_no_momentum_buffer():
    kw = dict(lr=0.5, momentum=0.9, dampening=0.5)
    ours, theirs = twins(13)
    sd = copy.deepcopy(zo.SGD(ours, **kw).state_dict())
    assert all("momentum_buffer" not in entry for entry in sd["state"].values())
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    loaded = torch.optim.SGD(theirs, foreach=False, **kw)
    loaded.load_state_dict(sd)
    ref = torch.optim.SGD(fresh, foreach=False, **kw)
    for s in range(2):
        step_both(loaded, ref, theirs, fresh, s)
    assert_close(theirs, fresh)


# 11 ---------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_optimizer_steps_its_own_copies(how):
    ours, theirs = twins(14, torch.bfloat16)
    theirs = [torch.nn.Parameter(p.detach().float()) for p in ours]
    oz, ot = pair("AdamW", ours, theirs, lr=0.01)
    step_both(oz, ot, ours, theirs, 0)
    cz = copy.deepcopy(oz) if how == "deepcopy" else pickle.loads(pickle.dumps(oz))
    ct = copy.deepcopy(ot)
    before = [p.detach().clone() for p in ours]
    copies, ref = cz.param_groups[0]["params"], ct.param_groups[0]["params"]
    for s in range(1, 4):
        step_both(cz, ct, copies, ref, s)
    assert all(torch.equal(a, b) for a, b in zip(ours, before))
    assert_close([p.float() for p in copies], ref, tol=2.0 ** -8)


# 12 ---------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_gradient_and_parameter_are_refused_by_name():
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = zo.SGD([p], lr=0.1)
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(TypeError, match="parameter 0 of param group 0 has a torch.sparse_coo"):
        opt.step()
    csr = torch.nn.Parameter(torch.randn(3, 3).to_sparse_csr())
    with pytest.raises(TypeError, match="parameter 0 of param group 0 has layout"):
        zo.SGD([csr], lr=0.1)


# 14 ---------------------------------------------------------------------------

def test_load_state_dict_hooks_run():
    ours, _ = twins(15)
    opt = zo.Adam(ours)
    sd = opt.state_dict()
    calls = []

    def pre(optimizer, state_dict):
        calls.append("pre")
        state_dict = copy.deepcopy(state_dict)
        state_dict["param_groups"][0]["lr"] = 0.25  # a hook may return a new dict
        return state_dict

    opt.register_load_state_dict_pre_hook(pre)
    opt.register_load_state_dict_post_hook(lambda optimizer: calls.append("post"))
    opt.load_state_dict(sd)
    assert calls == ["pre", "post"]
    assert opt.param_groups[0]["lr"] == 0.25


# 15 ---------------------------------------------------------------------------

def test_gradient_that_is_a_transposed_view_of_its_slot():
    ours, theirs = twins(16, shapes=[(4, 4), (3,)])
    oz, ot = pair("SGD", ours, theirs, lr=0.1)
    set_grads(ours, 99)  # zero_grad(set_to_none=False) keeps only existing gradients
    for s in range(3):
        oz.zero_grad(set_to_none=False)
        set_grads(theirs, s)
        for p, t in zip(ours, theirs):
            p.grad.copy_(t.grad.t() if t.dim() == 2 else t.grad)
        ours[0].grad = ours[0].grad.t()  # a view of the slot, not the slot
        oz.step()
        ot.step()
    assert_close(ours, theirs)


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_a_tensor_for_params_is_refused_as_torch_refuses_it(name):
    """list() of a tensor gave its rows: SGD trained 3 views of a (3, 4)
    tensor's rows, AdamW blamed a non-leaf tensor."""
    for params in (torch.zeros(3, 4), torch.nn.Parameter(torch.zeros(3))):
        with pytest.raises(TypeError, match="params must be an iterable of Tensors"):
            getattr(zo, name)(params, lr=0.1)
