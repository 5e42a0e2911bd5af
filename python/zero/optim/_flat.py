"""The flat-buffer base of zero.optim's CPU optimizers.

Each param group is laid out, per dtype, in one contiguous flat buffer (a
"segment"): the parameters become views into it, their optimizer states are
views into flat fp32 buffers of the same layout, and a step is one call into
the C core over the whole segment instead of one kernel per tensor.

[Note: flat segments]
- fp32 parameters are their own master copy. bf16/fp16 parameters get an
  fp32 master buffer; the core updates the master and writes the rounded
  parameters back in the same pass (copy-out).
- Gradients are gathered into a flat gradient buffer. A gradient that is
  already a view of it (after zero_grad(set_to_none=False)) costs nothing;
  any other gradient is copied in at step() and the parameter's .grad is
  re-pointed to the view, so later in-place accumulation lands in place.
- As in torch.optim, a parameter whose .grad is None is not updated and its
  step count does not advance. Parameters that take part are stepped in runs
  of neighbours with the same step count, one core call per run.
- Per-parameter state in self.state[p] holds views into the flat buffers,
  so state_dict() has torch.optim's layout and loads into torch's optimizer
  of the same kind.

[Note: changes made outside step()]
torch.optim reads the parameters and self.state afresh at every step, so
users change them freely between steps. The core holds raw pointers and
the flat buffers hold the values, so before each step (and state_dict,
load_state_dict) _sync() takes in what was changed since the last one:
- storage moved under a buffer (p.share_memory_()): its _C.Buffer is made
  again, as the old pointer is freed memory;
- p.data replaced: an equal kind of tensor is copied into the slot and p
  re-pointed to it; a cast, moved or resized one is refused by name;
- a 16-bit parameter written in place (its version counter moved): the
  elements that differ from the rounded master go into the master;
- self.state entries that are not the views published here (state.clear(),
  a replaced tensor): missing ones start afresh, replaced ones are copied in.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.autograd.graph import increment_version

from zero.optim._segments import Segment, where
from zero.sharding._param_writes import record_parameters, take_changed_elements
from zero.sharding._shared_memory import first_shared_pair, memory_span, shared_memory_error
from zero.step._hyperparameters import check_group_settings
from zero.step._registry import OptimizerSpec, decoupled

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FlatOptimizer(torch.optim.Optimizer):
    """Base class: flattening, gradient gathering, runs and state dicts.

    Subclasses name their optimizer's spec (step/_registry.py): its fp32
    states, which are in use for a group, and the core function one run
    calls. The spec's lazy states exist, as in torch, only from a
    parameter's first step with them in use; until then they are not
    published.
    """

    spec: OptimizerSpec  # set by each subclass

    def __init__(self, params, defaults):
        if isinstance(params, torch.Tensor):  # list() of it gave its rows, as torch refuses
            raise TypeError("params must be an iterable of Tensors or dicts (as torch.optim "
                            f"takes them), got a {type(params).__name__}; pass [tensor]")
        self._init_layout()
        params = list(params)
        if params and isinstance(params[0], dict):
            params = [dict(g, params=_as_list(g["params"])) for g in params]
            # before any group moves into a segment, which ends the sharing
            _refuse_shared_memory(params)
        super().__init__(params, defaults)

    def _init_layout(self):
        self._segments: list[list[Segment]] = []
        self._laid_out: list | None = []  # each group's params as laid out
        self._off_host = None  # why the parameters cannot be flattened here

    # ---- copies -------------------------------------------------------------

    def __setstate__(self, state):
        """copy.deepcopy and pickle, as with torch.optim, give an optimizer
        over copies of the parameters; the copy lays them out in flat
        buffers of its own and takes the copied state in."""
        super().__setstate__(state)
        if "_segments" in self.__dict__:
            return  # torch's load_state_dict calls this on a live optimizer
        self._lay_out_again()

    def _resume_after_engine(self):
        """A zero Engine's close(): the parameters are plain tensors again
        and self.state holds what the engine gave back, if anything (see
        _release_buffers); lay them out in buffers of our own and take it in,
        so that step() updates them (it did nothing after an engine)."""
        if self._off_host is None and self._laid_out is None:
            self._lay_out_again()

    def _lay_out_again(self):
        """The param groups laid out anew, self.state taken in."""
        groups, saved = self.param_groups, self.state
        self._init_layout()
        self.param_groups, self.state = [], defaultdict(dict)
        for group in groups:
            self.add_param_group(group)
        for group, segments in zip(self.param_groups, self._segments):
            for seg in segments:
                for i, p in enumerate(seg.params):
                    self._adopt_entry(seg, i, saved.get(p) or {}, group,
                                      master_from_param=False)
                self._publish_state(seg)

    # ---- layout --------------------------------------------------------

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        try:
            by_dtype = self._check_group(len(self.param_groups) - 1)
        except Exception:
            # torch appended it already; kept, later groups would pair
            # with the wrong segments
            self.param_groups.pop()
            raise
        group = self.param_groups[-1]
        self._laid_out.append(tuple(group["params"]))
        if self._off_host is not None:
            # a zero Engine drives it there with its own states (it reads
            # only the hyperparameters); on its own it cannot step
            self._segments.append([])
            return
        group_index = len(self.param_groups) - 1
        self._segments.append([self._flatten(ps, group, group_index)
                               for ps in by_dtype.values()])

    def _check_group(self, group_index: int) -> dict:
        """The group's parameters by dtype, or an error naming the first
        one that cannot be laid out."""
        params = self.param_groups[group_index]["params"]
        if len({id(p) for p in params}) != len(params):
            raise ValueError(f"param group {group_index} lists a parameter twice; "
                             "pass each (tied) parameter once")
        by_dtype: dict = {}
        off_host = self._off_host
        for i, p in enumerate(params):
            where = f"parameter {i} of param group {group_index}"
            if p.device.type == "meta" and off_host is None:
                # built as torch's are on a meta model (zero.estimate_memory
                # builds the config's optimizer so); step() refuses
                off_host = f"{where} is on the meta device: it has no values to update"
            elif p.device.type != "cpu" and off_host is None:
                off_host = f"{where} is on {p.device}"
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{where} has dtype {p.dtype}; supported: float32, "
                                "bfloat16, float16")
            if p.layout != torch.strided:
                raise TypeError(f"{where} has layout {p.layout}; zero.optim needs dense "
                                "(torch.strided) parameters")
            by_dtype.setdefault(p.dtype, []).append(p)
        # the earlier groups' parameters are in segments by now: this
        # compares with their memory there (a view of a segment is refused)
        _refuse_shared_memory(self.param_groups[:group_index + 1])
        self._off_host = off_host
        return by_dtype

    def _flatten(self, params, group, group_index: int) -> Segment:
        dtype = params[0].dtype
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        param_flat = torch.empty(total, dtype=dtype)
        for p, start in zip(params, offsets):
            param_flat[start:start + p.numel()].copy_(p.detach().reshape(-1))
        master = param_flat if dtype == torch.float32 else param_flat.float()
        index_in_group = {id(p): i for i, p in enumerate(group["params"])}
        seg = Segment(params=list(params), indices=[index_in_group[id(p)] for p in params],
                       offsets=offsets, shapes=[p.shape for p in params],
                       param_flat=param_flat, master=master,
                       grad_flat=torch.zeros(total, dtype=dtype),
                       steps=torch.zeros(len(params), dtype=torch.float32),
                       group_index=group_index, started=[False] * len(params))
        for i, p in enumerate(params):
            # The parameter keeps its identity; only its storage moves.
            p.data = seg.view(param_flat, i)
        seg.make_buffer("master")
        seg.make_buffer("grad")
        if dtype == torch.float32:
            seg.buffers["copy_out"] = None
        else:
            seg.make_buffer("copy_out")
        self._ensure_states(seg, group)
        self._publish_state(seg)
        record_parameters([seg])
        return seg

    def _ensure_states(self, seg: Segment, group):
        """Allocate the states this group's settings use (amsgrad or
        momentum may be switched on after construction)."""
        missing = [n for n in self._states_in_use(group) if n not in seg.states]
        for name in missing:
            seg.states[name] = torch.full((seg.numel,), self._initial_state_value(name, group),
                                          dtype=torch.float32)
            seg.make_buffer(name)
            if name in self.spec.lazy_states:
                seg.started = [False] * len(seg.params)
        if missing:
            self._publish_state(seg)

    def _publish_state(self, seg: Segment, which=None):
        """self.state[p] as views into the flat buffers, remembered so that
        an entry replaced by the user is noticed (_take_in_state)."""
        if len(seg.published) != len(seg.params):
            seg.published = [None] * len(seg.params)
        for i in range(len(seg.params)) if which is None else which:
            entry = {"step": seg.steps[i]}
            for name, flat in seg.states.items():
                if name not in self.spec.lazy_states or seg.started[i]:
                    entry[name] = seg.view(flat, i)
            if seg.master is not seg.param_flat:
                entry["master_param"] = seg.view(seg.master, i)
            self.state[seg.params[i]] = entry
            seg.published[i] = (entry, tuple(entry.items()))

    def _release_buffers(self):
        """Called by a zero Engine that takes this optimizer over: the
        engine keeps its own partitioned states, so ours are freed."""
        self._segments = [[] for _ in self.param_groups]
        self.state.clear()
        self._laid_out = None

    # ---- the optimizer's spec (step/_registry.py) ----------------------

    def _states_in_use(self, group) -> tuple:
        return tuple(self.spec.states(group))

    def _initial_state_value(self, name: str, group) -> float:
        return self.spec.states(group).get(name, 0.0)

    def _update(self, seg: Segment, group, start: int, stop: int, step: int,
                grad_scale: float, fresh: bool):
        """One run [start, stop) of a segment through the C core. fresh: the
        run's lazy states do not exist yet (step() has applied maximize)."""
        args, kwargs = self.spec.arguments(group, seg.buffers, step, fresh,
                                           decoupled(self, group))
        self.spec.host(*args, **kwargs, grad_scale=grad_scale, start=start, stop=stop)

    # ---- changes made outside step(): see [Note: changes made outside step()]

    def _sync(self):
        if self._off_host is not None or self._laid_out is None:
            return
        self._check_layout()
        for group, segments in zip(self.param_groups, self._segments):
            for seg in segments:
                self._refresh_buffers(seg)
                self._take_back_params(seg)
                self._take_in_writes(seg)
                self._take_in_state(seg, group)
                self._ensure_states(seg, group)

    def _check_layout(self):
        if len(self.param_groups) != len(self._laid_out):
            raise RuntimeError(
                f"optimizer.param_groups has {len(self.param_groups)} groups but "
                f"{len(self._laid_out)} were laid out: a group was added to or removed from "
                "the list directly. Use add_param_group, or build a new optimizer")
        for g, (group, laid_out) in enumerate(zip(self.param_groups, self._laid_out)):
            params = group["params"]
            if len(params) != len(laid_out) or any(a is not b for a, b in zip(params, laid_out)):
                raise RuntimeError(
                    f"param_groups[{g}]['params'] was changed after the optimizer laid it out "
                    f"(it had {len(laid_out)} parameters, now {len(params)}, not all the same); "
                    "zero.optim steps the "
                    "parameters it laid out in flat buffers. Use add_param_group for new "
                    "parameters, or build a new optimizer (del this one first)")

    def _refresh_buffers(self, seg: Segment):
        """A Buffer holds the address its tensor had when it was made;
        share_memory_() moves the storage and frees that block."""
        for name, buffer in seg.buffers.items():
            if buffer is not None and seg.tensor_of(name).data_ptr() != seg.pointers[name]:
                seg.make_buffer(name)

    def _take_back_params(self, seg: Segment):
        """Re-point a parameter whose .data was replaced by an equal kind of
        tensor (p.data = ...); refuse one cast, moved or resized."""
        for i, p in enumerate(seg.params):
            if seg.is_slot(seg.param_flat, p, i):
                continue
            shape, dtype = seg.shapes[i], seg.param_flat.dtype
            if p.dtype != dtype or p.device.type != "cpu" or p.shape != shape or \
                    p.layout != torch.strided:
                raise RuntimeError(
                    f"{where(seg, i)} is now {p.dtype} {tuple(p.shape)} on {p.device}, but "
                    f"this optimizer was built for {dtype} {tuple(shape)} on cpu: it was cast, "
                    "moved or resized (p.data = ..., model.to(...), model.float()) after the "
                    "optimizer was built. Cast it back, or build a new optimizer over the "
                    "parameters as they are now (del this one first)")
            slot = seg.view(seg.param_flat, i)
            slot.copy_(p.detach())
            p.data = slot
            seg.seen_versions[i] = -1  # its new values go into the master below

    def _take_in_writes(self, seg: Segment):
        """Values written into a 16-bit parameter since the last step go into
        the master; elements the write left as they were keep their fp32
        bits (see _param_writes' [Note: parameter writes])."""
        if seg.master is seg.param_flat:
            return
        for i, p in enumerate(seg.params):
            if p._version == seg.seen_versions[i]:
                continue
            take_changed_elements(seg.view(seg.master, i), seg.view(seg.param_flat, i))
            seg.seen_versions[i] = p._version

    def _take_in_state(self, seg: Segment, group):
        changed = []
        for i, p in enumerate(seg.params):
            entry = self.state.get(p)
            published, items = seg.published[i]
            if entry is published and len(entry) == len(items) and \
                    all(entry.get(k) is v for k, v in items):
                continue
            entry = entry or {}
            self._check_entry(seg, i, entry, "opt.state[p]")
            self._adopt_entry(seg, i, entry, group, master_from_param=False)
            changed.append(i)
        if changed:
            self._publish_state(seg, changed)

    def _check_entry(self, seg: Segment, i: int, entry: dict, source: str):
        for name, value in entry.items():
            if name == "step" or value is None or not isinstance(value, torch.Tensor):
                continue
            if value.shape != seg.shapes[i]:
                raise ValueError(
                    f"{source}['{name}'] of {where(seg, i)} has shape {tuple(value.shape)}, "
                    f"the parameter {tuple(seg.shapes[i])}: it belongs to another parameter "
                    "or model. Load a state of this model's parameters, in the same order")

    def _adopt_entry(self, seg: Segment, i: int, entry: dict, group, *,
                     master_from_param: bool):
        """Copy one parameter's state from entry (torch's layout or ours);
        what it lacks starts afresh, as torch.optim does for a parameter
        with no state. master_from_param: with no master_param, the master
        is the parameter's value (a torch.optim state dict has none)."""
        if "step" in entry:
            seg.steps[i] = float(entry["step"])
        else:
            # torch's SGD keeps no step: a momentum buffer means it has run.
            seg.steps[i] = 1.0 if entry else 0.0
        for name, flat in seg.states.items():
            view = seg.view(flat, i)
            value = entry.get(name)
            if value is None:
                view.fill_(self._initial_state_value(name, group))
            elif value is not view:
                view.copy_(value)
        seg.started[i] = all(entry.get(n) is not None for n in self.spec.lazy_states
                             if n in seg.states)
        if seg.master is seg.param_flat:
            return
        master = seg.view(seg.master, i)
        if entry.get("master_param") is not None:
            master.copy_(entry["master_param"])
            seg.view(seg.param_flat, i).copy_(master)
        elif master_from_param:
            master.copy_(seg.view(seg.param_flat, i))

    # ---- step -------------------------------------------------------------

    def _gather_grads(self, seg: Segment) -> list:
        """Bring every gradient into the flat buffer; which params have one."""
        present = []
        for i, p in enumerate(seg.params):
            g = p.grad
            if g is None:
                present.append(False)
                continue
            if g.layout != torch.strided:
                # before data_ptr(), which a sparse tensor does not have
                raise TypeError(f"{where(seg, i)} has a {g.layout} gradient; zero.optim "
                                "needs dense gradients (use torch.optim's SparseAdam, or "
                                "sparse=False in the embedding)")
            if not seg.is_slot(seg.grad_flat, g, i):
                if g.untyped_storage().data_ptr() == seg.grad_flat.untyped_storage().data_ptr():
                    g = g.clone()  # a view of the buffer itself (.t()): copy_ may not overlap
                view = seg.view(seg.grad_flat, i)
                view.copy_(g)
                p.grad = view
            present.append(True)
        return present

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0):
        """One update of every parameter that has a gradient.

        grad_scale multiplies every gradient inside the same pass: an engine
        folds loss-scale unscaling and the clip coefficient into it.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not math.isfinite(grad_scale):
            raise ValueError(f"grad_scale must be finite, got {grad_scale}")
        if self._off_host is not None:
            if any(p.device.type == "meta" for g in self.param_groups for p in g["params"]):
                raise ValueError(self._off_host)  # no device would give it values
            raise ValueError(f"{self._off_host}; zero.optim optimizers step on the CPU: pass "
                             "this one to zero.initialize, which runs it on the parameters' "
                             "device, or use torch.optim's")
        self._sync()
        self._check_every_group(grad_scale)
        for group, segments in zip(self.param_groups, self._segments):
            scale = -grad_scale if group.get("maximize", False) else grad_scale
            lazy = [n for n in self._states_in_use(group) if n in self.spec.lazy_states]
            for seg in segments:
                self._step_segment(seg, group, scale, lazy)
        return loss

    def _check_every_group(self, grad_scale: float):
        """Each group's settings through the core's argument checks, over no
        elements, before the first group is updated: a later group's bad
        setting (a schedule that made its lr negative) left the earlier
        groups updated and their step counts advanced."""
        for index, (group, segments) in enumerate(zip(self.param_groups, self._segments)):
            if segments:
                try:
                    check_group_settings(group)
                    self._update(segments[0], group, 0, 0, 1, grad_scale, True)
                except (ValueError, TypeError) as error:
                    raise type(error)(f"param group {index}: {error}; nothing was "
                                      "updated") from None

    def _step_segment(self, seg: Segment, group, scale: float, lazy: list):
        present = self._gather_grads(seg)
        steps = seg.steps.tolist()
        keys = list(zip(steps, seg.started))
        now_started = []
        for first, last in _runs(present, keys):
            start = seg.offsets[first]
            stop = seg.offsets[last - 1] + seg.shapes[last - 1].numel()
            self._update(seg, group, start, stop, int(steps[first]) + 1, scale,
                         not seg.started[first])
            seg.steps[first:last] += 1
            if lazy and not seg.started[first]:
                now_started.extend(range(first, last))
        for i in now_started:
            seg.started[i] = True
        if now_started:
            self._publish_state(seg, now_started)
        stepped = [p for p, here in zip(seg.params, present) if here]
        if stepped:
            # as torch.optim's in-place update does: autograd then refuses a
            # backward through a graph built before the step
            increment_version(stepped)
        record_parameters([seg])

    def zero_grad(self, set_to_none: bool = True):
        """As torch.optim: set_to_none=False zeroes the gradients in place
        (only those that exist: a parameter with no gradient keeps None and
        is not stepped) as views of the flat gradient buffer, so backward
        accumulates there with no copy at step()."""
        if set_to_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        for segments in self._segments:
            for seg in segments:
                for i, p in enumerate(seg.params):
                    if p.grad is None:
                        continue
                    view = seg.view(seg.grad_flat, i)
                    view.zero_()
                    p.grad = view

    # ---- state dicts --------------------------------------------------------

    def state_dict(self):
        self._sync()
        return super().state_dict()

    def load_state_dict(self, state_dict):
        """Load a state dict of this optimizer, or of the torch.optim
        optimizer of the same kind when the param groups have the same
        sizes. Values are copied into the flat buffers; fp32 states keep
        their precision whatever the parameters' dtype. Hooks run as in
        torch.optim's load_state_dict."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._sync()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state_dict has {len(groups)} param groups, this "
                             f"optimizer has {len(self.param_groups)}")
        for g_index, (saved, group) in enumerate(zip(groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group {g_index} has {len(group['params'])} parameters, the "
                    f"state_dict's has {len(saved['params'])}")
        saved_state = state_dict["state"]
        entries = []  # (seg, i, entry), all checked before anything is loaded
        for saved, group, segments in zip(groups, self.param_groups, self._segments):
            for seg in segments:
                for i in range(len(seg.params)):
                    entry = saved_state.get(saved["params"][seg.indices[i]], {})
                    self._check_entry(seg, i, entry, "state_dict['state']")
                    entries.append((seg, i, entry))
        for saved, group in zip(groups, self.param_groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        for group, segments in zip(self.param_groups, self._segments):
            for seg in segments:
                self._ensure_states(seg, group)
        for seg, i, entry in entries:
            group = self.param_groups[seg.group_index]
            self._adopt_entry(seg, i, entry, group, master_from_param=True)
        for segments in self._segments:
            for seg in segments:
                self._publish_state(seg)
                record_parameters([seg])
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _as_list(params) -> list:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _refuse_shared_memory(groups):
    """See _shared_memory.py: parameters that share memory would be laid
    out apart."""
    shared = first_shared_pair((f"parameter {i} of param group {gi}", memory_span(p))
                               for gi, group in enumerate(groups)
                               for i, p in enumerate(_as_list(group["params"])))
    if shared is not None:
        raise shared_memory_error(*shared, "Pass one Parameter for both")
    for gi, group in enumerate(groups):
        for i, p in enumerate(_as_list(group["params"])):
            if isinstance(p, torch.Tensor) and torch._debug_has_internal_overlap(p) == 1:
                # laid out flat, each element would train apart; torch.optim refuses it
                raise ValueError(f"parameter {i} of param group {gi} has elements that share "
                                 f"memory (an expanded tensor, strides {tuple(p.stride())}); "
                                 "torch's optimizers refuse it too. Pass "
                                 "nn.Parameter(t.contiguous()) instead")


def _runs(present: list, keys: list):
    """Maximal [first, last) index runs of present params with equal keys
    (step count, lazy states started)."""
    first = None
    for i, here in enumerate(present):
        if first is not None and (not here or keys[i] != keys[first]):
            yield first, i
            first = None
        if here and first is None:
            first = i
    if first is not None:
        yield first, len(present)
