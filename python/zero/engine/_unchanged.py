"""The check before each step that the optimizer and the trained parameters
are as they were at zero.initialize: the engine laid out its partitions and
states for them then, and a change since would be ignored silently, so it
is refused.

[Note: the unchanged check] The whole check walks model.named_parameters(),
0.14 ms a step for an 8-block GPT and more for a larger model, at every
stage. So the engine keeps a snapshot of what the walk last passed: the
module list, and what hangs off each module (its children and its
parameters: identity and requires_grad each). A step compares the
snapshot, read with maps that loop in C (a third of the walk's time), and
takes the whole walk (and a new snapshot) on any difference: a module added
or removed anywhere changes the children of a module in the list, and a
parameter replaced, even by a write into `_parameters`, changes its
identity. A parameter's engine (`_zero_place`) cannot change while this
engine is open: another initialize refuses parameters a live engine
trains, or closes this engine first."""
from __future__ import annotations

from functools import partial
from itertools import chain
from operator import attrgetter, is_not

from zero.engine._script_grad_hooks import warn_of_script_post_accumulate_hooks

_REQUIRES_GRAD, _GRAD = attrgetter("requires_grad"), attrgetter("grad")
_CHILDREN, _PARAMETERS = attrgetter("_modules"), attrgetter("_parameters")
_IS_SET = partial(is_not, None)


def check_optimizer_unchanged(engine):
    groups = engine.optimizer.param_groups
    if len(groups) != engine._param_groups_seen:
        raise RuntimeError(
            f"the optimizer has {len(groups)} param groups, but had "
            f"{engine._param_groups_seen} at zero.initialize (add_param_group after "
            "initialize): the engine partitions only the groups it was given. Call "
            "zero.initialize again with the optimizer as it is now")
    _check_group_members(engine, groups)
    if engine.policy.reduces_in_backward:
        _check_no_grads_set_by_hand(engine)
    if engine._frozen_in_optimizer:
        _check_frozen_without_grads(engine._frozen_in_optimizer)
    if engine.policy.reduces_in_backward and not engine._script_hooks_checked:
        engine._script_hooks_checked = True  # at the first step only: a walk of every parameter
        warn_of_script_post_accumulate_hooks(engine)
    for fg in engine.groups:
        missing = set(engine._spec.states(groups[fg.index])) - set(fg.states)
        if missing:
            raise ValueError(
                f"param group {fg.index} now needs optimizer state {sorted(missing)} "
                "(amsgrad or momentum turned on after zero.initialize), which the engine "
                "did not allocate: set it before initialize, or call zero.initialize again")
    snapshot = getattr(engine, "_unchanged_snapshot", None)
    if snapshot is not None and _describe(snapshot[0]) == snapshot[1]:
        return
    _check_every_parameter(engine)
    modules = list(engine.module.modules())
    engine._unchanged_snapshot = (modules, _describe(modules))


def frozen_in_optimizer(param_groups, module) -> list:
    """(name, parameter) of each parameter that does not require grad in
    the optimizer's groups (usually none: scripts pass the trainable ones)."""
    names = {id(p): name for name, p in module.named_parameters()}
    return [(names.get(id(p), "?"), p) for group in param_groups for p in group["params"]
            if not p.requires_grad]


def _check_frozen_without_grads(frozen):
    """A frozen parameter in the optimizer with a .grad set by hand: torch.optim
    steps any parameter with a .grad, the engine only those that required grad
    at initialize, so the step dropped the gradient silently, at every stage."""
    for name, p in frozen:
        if p.grad is not None and not p.requires_grad:
            raise RuntimeError(
                f"parameter '{name}' does not require grad but has a .grad (set by hand: "
                "p.grad = ...): torch.optim would step it with that gradient; the engine "
                "trains only the parameters that required grad at zero.initialize, so the "
                "step would ignore it. Set requires_grad=True before zero.initialize (it "
                "then takes its gradient from backward), or leave its .grad None")


def group_members(param_groups) -> list:
    """Each param group's parameters by identity, in order: what the
    engine laid out its groups for, kept at initialize."""
    return [tuple(map(id, group["params"])) for group in param_groups]


def _check_group_members(engine, groups):
    """A group's parameters changed since initialize (group["params"]
    edited or replaced, the groups reordered) trained as before, silently:
    each flat group keeps the parameters it was built with and reads its
    settings by position, so a parameter moved into a group of lr 0 kept
    its old group's lr. zero.optim's own optimizer refuses the same edit."""
    seen = engine._group_members_seen
    for index, (group, members) in enumerate(zip(groups, seen)):
        if tuple(map(id, group["params"])) != members:
            now = {id(p) for p in group["params"]}
            name = {id(p): n for n, p in engine.module.named_parameters()}
            gone = [name.get(i, "?") for i in members if i not in now]
            came = [name.get(id(p), "a tensor not in the model") for p in group["params"]
                    if id(p) not in set(members)]
            change = (f"without {gone[:3]}" if gone else "") + \
                (" and " if gone and came else "") + (f"with {came[:3]}" if came else "") \
                or "in another order"
            raise RuntimeError(
                f"param group {index} of the optimizer holds other parameters than at "
                f"zero.initialize ({change}; group['params'] edited, or the groups "
                "reordered): the engine laid out its partitions, states and settings for "
                "the groups as they were, and would train them so. To change which "
                "parameters train or their settings' groups, call zero.initialize again "
                "with the optimizer as it is then")


def _check_no_grads_set_by_hand(engine):
    """Stages 2-3 take each gradient from backward (a hook moves it into
    a bucket and leaves .grad None), so a .grad set by hand since (p.grad =
    g after torch.autograd.grad) was never reduced nor stepped on: the
    step ran on zero gradients, silently. Refused by name. Stages 0-1 take
    such a .grad in at the boundary (FlatGroup.gather_stray_grads)."""
    for fg in engine.groups:
        if fg.trainable and any(map(_IS_SET, map(_GRAD, fg.params))):
            i = next(i for i, p in enumerate(fg.params) if p.grad is not None)
            raise RuntimeError(
                f"parameter '{fg.names[i]}' has a .grad set outside backward (p.grad = ..., "
                f"as after torch.autograd.grad); at stage {engine.stage} the engine takes "
                "gradients from backward only (each is reduced into its partition as it "
                "comes), so the step would ignore it. Compute gradients with "
                "engine.backward(loss) or loss.backward() (backward(inputs=...) for a "
                "subset), or use stage 0-1, which take a .grad set by hand")


def _describe(modules):
    """What hangs off `modules`: each one's children, and each parameter's
    identity and requires_grad ([Note: the unchanged check])."""
    children = chain.from_iterable(map(dict.values, map(_CHILDREN, modules)))
    params = list(filter(_IS_SET, chain.from_iterable(map(dict.values,
                                                          map(_PARAMETERS, modules)))))
    return list(map(id, children)), list(map(id, params)), list(map(_REQUIRES_GRAD, params))


def _trained_by(engine, p) -> bool:
    place = getattr(p, "_zero_place", None)
    return place is not None and place.engine() is engine and place.fg.trainable


def _check_every_parameter(engine):
    for name, p in engine.module.named_parameters():
        place = getattr(p, "_zero_place", None)
        trained = _trained_by(engine, p)
        if p.requires_grad and place is None and p.is_floating_point() and \
                id(p) not in engine._params_at_initialize:
            raise RuntimeError(
                f"parameter '{name}' is not one zero.initialize was given: a parameter "
                "added or replaced since (a new module or head, module.weight = "
                "nn.Parameter(...), load_state_dict(assign=True)), which the engine neither "
                "partitions nor trains. Call zero.initialize again after changing the "
                "model's parameters (DeepSpeed too builds its partitions once, at "
                "initialize); to load values into the parameters the engine trains, "
                "load_state_dict without assign=True")
        if p.requires_grad and not trained and p.is_floating_point():
            # the backward before this refused step gave them gradients no
            # step takes: dropped, or a later step (the parameters frozen
            # again) found them as gradients on frozen parameters
            for q in engine.module.parameters():
                if q.requires_grad and not _trained_by(engine, q):
                    q.grad = None
            raise RuntimeError(
                f"parameter '{name}' requires grad, but was frozen (or not in the model) at "
                "zero.initialize, so the engine does not train it. Call zero.initialize "
                "again after changing which parameters train: with this optimizer where the "
                "parameters that now train sit in param groups of their own (a group without "
                "states starts afresh), else with a new optimizer (DeepSpeed too builds its "
                "partitions once, at initialize, and does not follow a later change; zero "
                "refuses rather than train other parameters than you set)")
        if trained and not p.requires_grad:
            raise RuntimeError(
                f"parameter '{name}' was set to requires_grad=False after zero.initialize; "
                "the engine would still update it. Call zero.initialize again after "
                "changing which parameters train (DeepSpeed too builds its partitions once, "
                "at initialize, and does not follow a later change; zero refuses rather "
                "than train other parameters than you set)")
