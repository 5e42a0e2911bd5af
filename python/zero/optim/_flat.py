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
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from zero import _C

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _buffer(tensor: torch.Tensor) -> _C.Buffer:
    return _C.Buffer(tensor.detach())


@dataclass
class _Segment:
    """The parameters of one group that share a dtype, laid out flat."""

    params: list
    offsets: list               # element offset of each parameter
    param_flat: torch.Tensor    # [numel] the parameters' own storage
    master: torch.Tensor        # [numel] fp32; param_flat itself for fp32
    grad_flat: torch.Tensor     # [numel] param dtype
    steps: torch.Tensor         # [len(params)] float32 per-parameter counts
    states: dict = field(default_factory=dict)   # name -> [numel] fp32
    buffers: dict = field(default_factory=dict)  # name -> _C.Buffer

    @property
    def numel(self) -> int:
        return self.param_flat.numel()

    def view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        p = self.params[index]
        start = self.offsets[index]
        return flat[start:start + p.numel()].view_as(p)


def check_hyperparameters(**values) -> list:
    """Raise ValueError naming the first out-of-range hyperparameter (a
    beta in [0, 1), anything else finite and >= 0); the values as floats,
    in the order given."""
    floats = []
    for name, value in values.items():
        v = float(value)
        if name.startswith("beta"):
            if not 0.0 <= v < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        elif not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        floats.append(v)
    return floats


class FlatOptimizer(torch.optim.Optimizer):
    """Base class: flattening, gradient gathering, runs and state dicts.

    Subclasses name their fp32 states (STATE_NAMES), say which are in use for
    a group (_states_in_use) and run the core for one run (_update).
    """

    STATE_NAMES: tuple = ()

    def __init__(self, params, defaults):
        self._segments: list[list[_Segment]] = []
        self._off_host = None  # why the parameters cannot be flattened here
        super().__init__(params, defaults)

    # ---- layout --------------------------------------------------------

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group_index = len(self.param_groups) - 1
        by_dtype: dict = {}
        if len({id(p) for p in group["params"]}) != len(group["params"]):
            raise ValueError(f"param group {group_index} lists a parameter twice; "
                             "pass each (tied) parameter once")
        for i, p in enumerate(group["params"]):
            where = f"parameter {i} of param group {group_index}"
            if p.device.type == "meta":
                raise ValueError(f"{where} is on the meta device: it has no values to update")
            if p.device.type != "cpu" and self._off_host is None:
                self._off_host = f"{where} is on {p.device}"
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{where} has dtype {p.dtype}; supported: float32, "
                                "bfloat16, float16")
            if p.is_sparse:
                raise TypeError(f"{where} is sparse; zero.optim needs dense parameters")
            by_dtype.setdefault(p.dtype, []).append(p)
        if self._off_host is not None:
            # a zero Engine drives it there with its own states (it reads
            # only the hyperparameters); on its own it cannot step
            self._segments.append([])
            return
        self._segments.append([self._flatten(ps, group) for ps in by_dtype.values()])

    def _flatten(self, params, group) -> _Segment:
        dtype = params[0].dtype
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        param_flat = torch.empty(total, dtype=dtype)
        for p, start in zip(params, offsets):
            param_flat[start:start + p.numel()].copy_(p.detach().reshape(-1))
        master = param_flat if dtype == torch.float32 else param_flat.float()
        seg = _Segment(params=list(params), offsets=offsets, param_flat=param_flat,
                       master=master, grad_flat=torch.zeros(total, dtype=dtype),
                       steps=torch.zeros(len(params), dtype=torch.float32))
        for i, p in enumerate(params):
            # The parameter keeps its identity; only its storage moves.
            p.data = seg.view(param_flat, i)
        seg.buffers["master"] = _buffer(master)
        seg.buffers["grad"] = _buffer(seg.grad_flat)
        seg.buffers["copy_out"] = None if dtype == torch.float32 else _buffer(param_flat)
        self._ensure_states(seg, group)
        return seg

    def _ensure_states(self, seg: _Segment, group):
        """Allocate the states this group's settings use (amsgrad or
        momentum may be switched on after construction)."""
        missing = [n for n in self._states_in_use(group) if n not in seg.states]
        for name in missing:
            flat = torch.full((seg.numel,), self._initial_state_value(name, group),
                              dtype=torch.float32)
            seg.states[name] = flat
            seg.buffers[name] = _buffer(flat)
        if missing or not seg.params or seg.params[0] not in self.state:
            self._publish_state(seg)

    def _publish_state(self, seg: _Segment):
        for i, p in enumerate(seg.params):
            entry = {"step": seg.steps[i]}
            for name, flat in seg.states.items():
                entry[name] = seg.view(flat, i)
            if seg.master is not seg.param_flat:
                entry["master_param"] = seg.view(seg.master, i)
            self.state[p] = entry

    def _release_buffers(self):
        """Called by a zero Engine that takes this optimizer over: the
        engine keeps its own partitioned states, so ours are freed."""
        self._segments = [[] for _ in self.param_groups]
        self.state.clear()

    # ---- hooks for subclasses -------------------------------------------

    def _states_in_use(self, group) -> tuple:
        return self.STATE_NAMES

    def _initial_state_value(self, name: str, group) -> float:
        return 0.0

    def _update(self, seg: _Segment, group, start: int, stop: int, step: int,
                grad_scale: float):
        raise NotImplementedError

    # ---- step -------------------------------------------------------------

    def _gather_grads(self, seg: _Segment, group_index: int) -> list:
        """Bring every gradient into the flat buffer; which params have one."""
        present = []
        grad_ptr = seg.grad_flat.data_ptr()
        item = seg.grad_flat.element_size()
        for i, p in enumerate(seg.params):
            g = p.grad
            if g is None:
                present.append(False)
                continue
            # torch guarantees a gradient has its parameter's shape and dtype
            if g.data_ptr() != grad_ptr + seg.offsets[i] * item:
                if g.is_sparse:
                    raise TypeError(f"parameter {i} of param group {group_index} has a "
                                    "sparse gradient; zero.optim needs dense gradients")
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
            raise ValueError(f"{self._off_host}; zero.optim optimizers step on the CPU: pass "
                             "this one to zero.initialize, which runs it on the parameters' "
                             "device, or use torch.optim's")
        for group_index, (group, segments) in enumerate(zip(self.param_groups,
                                                             self._segments)):
            scale = -grad_scale if group.get("maximize", False) else grad_scale
            for seg in segments:
                self._ensure_states(seg, group)
                present = self._gather_grads(seg, group_index)
                steps = seg.steps.tolist()
                for first, last in _runs(present, steps):
                    start = seg.offsets[first]
                    stop = seg.offsets[last - 1] + seg.params[last - 1].numel()
                    self._update(seg, group, start, stop, int(steps[first]) + 1, scale)
                    seg.steps[first:last] += 1
        return loss

    def zero_grad(self, set_to_none: bool = True):
        """As torch.optim: set_to_none=False zeroes the flat gradient buffer
        in place and keeps .grad as views of it, so backward accumulates there
        with no copy at step()."""
        if set_to_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
            return
        for segments in self._segments:
            for seg in segments:
                seg.grad_flat.zero_()
                for i, p in enumerate(seg.params):
                    p.grad = seg.view(seg.grad_flat, i)

    # ---- state dicts --------------------------------------------------------

    def load_state_dict(self, state_dict):
        """Load a state dict of this optimizer, or of the torch.optim
        optimizer of the same kind when the param groups have the same
        sizes. Values are copied into the flat buffers; fp32 states keep
        their precision whatever the parameters' dtype."""
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
        for saved, group, segments in zip(groups, self.param_groups, self._segments):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
            index_of = {id(p): saved["params"][i] for i, p in enumerate(group["params"])}
            for seg in segments:
                self._ensure_states(seg, group)
                for i, p in enumerate(seg.params):
                    entry = saved_state.get(index_of[id(p)], {})
                    self._load_entry(seg, i, entry, group)

    def _load_entry(self, seg: _Segment, i: int, entry: dict, group):
        if "step" in entry:
            seg.steps[i] = float(entry["step"])
        else:
            # torch's SGD keeps no step: a momentum buffer means it has run.
            seg.steps[i] = 1.0 if entry else 0.0
        for name, flat in seg.states.items():
            view = seg.view(flat, i)
            if name in entry and entry[name] is not None:
                view.copy_(entry[name])
            else:
                view.fill_(self._initial_state_value(name, group))
        if "master_param" in entry and seg.master is not seg.param_flat:
            seg.view(seg.master, i).copy_(entry["master_param"])
            seg.view(seg.param_flat, i).copy_(entry["master_param"])
        elif seg.master is not seg.param_flat:
            seg.view(seg.master, i).copy_(seg.view(seg.param_flat, i))


def _runs(present: list, steps: list):
    """Maximal [first, last) index runs of present params with equal steps."""
    first = None
    for i, here in enumerate(present):
        if first is not None and (not here or steps[i] != steps[first]):
            yield first, i
            first = None
        if here and first is None:
            first = i
    if first is not None:
        yield first, len(present)
