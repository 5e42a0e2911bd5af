"""zero.Engine: the training engine that zero.initialize returns.

It wraps the user's module in place: trainable parameters become views into
flat, partitioned buffers (_flat_group.FlatGroup), gradients are reduced
over ranks with SUM, and the update runs on this rank's partition (the C
core, or on a GPU zero's kernels: _step_path.py) with every scale folded
into one factor:

    grad_scale = clip_coefficient / (loss_scale * world_size * accumulation_steps)

[Note: boundary step] engine.step() is called after every micro-batch; it
acts only at the accumulation boundary: (1) reduce the gradients (stages
0-1; stage 2 reduced them during backward), (2) one sum of squares over this
rank's gradient partition, summed over ranks, gives the global norm and the
fp16 overflow check at once, (3) skip on overflow (fp16) or update, (4)
all-gather the updated parameters (stages 1-2), (5) zero the gradients and
step the LR scheduler (not on a skipped step).
"""
from __future__ import annotations

import contextlib
import math
import types
import weakref

import torch
from torch import nn

from zero.engine._agreement import check_ranks_agree
from zero.comm._comm import Comm, leave_process_group
from zero.engine._deepspeed_queries import DeepSpeedQueries
from zero.engine._routes import (AttributeRemoval, EngineZeroGrad, call_alive,
                                 model_zero_grad, refuse_states_call, submodule_zero_grad)
from zero.sharding._copying import ModuleHook
from zero.sharding._flat_group import FlatGroup
from zero.engine._interrupts import interrupts_held
from zero.step._loss_scaler import DynamicLossScaler
from zero.engine._memory import MemorySummary, zero_formula
from zero.step._registry import fresh_states, spec_for
from zero.sharding._shared_memory import first_shared_pair, memory_span, shared_memory_error
from zero.sharding._param_writes import (Place, bump_versions, check_parameters_in_place,
                                record_parameters, take_in_parameter_writes)
from zero.sharding._partitioned_init import sharded_record, take_values
from zero.step._resumed_states import (describe_held, give_back_optimizer_states,
                                  held_optimizer_states, take_in_optimizer_states)
from zero.sharding._backward import BackwardLifecycle
from zero.sharding._policy import StagePolicy
from zero.sharding._stage3 import Stage3Schedule
from zero.sharding._step_agreement import describe_settings
from zero.sharding._units import leaf_roots, parameter_names
from zero.step import _step_path
from zero.step._step_path import step_path_for
from zero.config._config import Config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Engine(DeepSpeedQueries, nn.Module):
    """What zero.initialize returns: the model wrapped for ZeRO training.
    Call it as the model (inputs are cast to the compute dtype), then
    engine.backward(loss) and engine.step(). Its attributes: module,
    optimizer, config, lr_scheduler, stage, global_steps, micro_steps.
    docs/engine.md describes it all."""

    def __init__(self, module: nn.Module, optimizer, config: Config, comm: Comm,
                 owns_group: bool, lr_scheduler=None):
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.lr_scheduler = lr_scheduler
        self._comm = comm
        self._spec = spec_for(optimizer)
        self.compute_dtype = DTYPES[config.precision]
        self.device = comm.device  # the model's; every buffer lives there
        # chosen before any hook is installed: a failure leaves no trace
        self._staged = _step_path.states_off_device(self.device, config.offload_optimizer)
        self.step_path = _step_path.StagedHostStep(self.device) if self._staged \
            else step_path_for(self.device)
        self.stage = config.stage
        self.policy = StagePolicy.of(config.stage)
        self.micro_steps = 0
        self.global_steps = 0
        self.step_was_skipped = False
        self._step_applied = False  # was_step_applied(): DeepSpeed's meaning
        self.skipped_steps = 0  # fp16 steps skipped on overflow (DeepSpeed's name)
        self._scaled_backward = False
        self._in_no_sync = False
        self._zero_grad_calls = 0  # since the last update
        self._prepared = None  # (sumsq, norm) once the boundary's reduction ran
        self._clip_norm = None
        self._hooks = []
        self._last_comm = comm.log.summary()
        self._closed = False
        self.loss_scaler = DynamicLossScaler(config.loss_scaling) \
            if config.precision == "fp16" else None

        # what can be refused is refused before the model is changed
        groups = self._match_param_groups(module, optimizer)
        owners = self._owners(module, config.stage3_leaf_modules) \
            if self.policy.partitions_params else None
        if not any(params for params, _names in groups):
            raise ValueError("the model has no trainable parameters (every parameter has "
                             "requires_grad=False); nothing to train")
        # a refusal of the held states is raised once the ranks have
        # compared them (raised on one rank alone, the others would wait)
        try:
            resumed, problem = held_optimizer_states(optimizer, groups), None
            held = describe_held(resumed)
        except ValueError as error:
            resumed, problem, held = {}, error, f"refused: {error}"
        check_ranks_agree(comm, module, optimizer, config, {"optimizer states": held})
        if problem is not None:
            raise problem
        self._schedule = None
        try:
            self._build(module, optimizer, config, comm, groups, owners, resumed)
        except BaseException:
            for h in self._hooks:
                h.remove()
            if self._schedule is not None:
                self._schedule.remove()
            if self.policy.releases_params:
                # released parameters hold no values now: say so to the
                # next initialize instead of training empty placeholders
                for p in module.parameters():
                    p._zero_lost = True
            raise
        # registered last: a failed __init__ leaves through initialize's
        # error path, not here too. A dropped engine leaves its group (a
        # notebook that rebinds `engine` without close() kept the in-memory
        # group for good); close() runs it at once, and it runs only once.
        self._leave_group = weakref.finalize(self, leave_process_group, owns_group)

    def _build(self, module, optimizer, config, comm, groups, owners, resumed):
        # the engine's gradients start at zero: a .grad left by a torch run
        # (its loop zeroes before backward) would otherwise join the first
        # step at stages 2-3 and be dropped at 0-1
        for params, _names in groups:
            for p in params:
                p.grad = None
        self._cast(module)
        for name, buf in module.named_buffers():
            _broadcast_buffer(comm, name, buf)
        # parameters outside the flat groups (which broadcast their own):
        # frozen ones at stages 0-2, integer ones at stage 3
        with torch.no_grad():
            for name, p in module.named_parameters():
                if not p.requires_grad and (not self.policy.partitions_params or not p.is_floating_point()):
                    _broadcast_buffer(comm, name, p.data, kind="parameter")
        offload = self._offload_files(config.offload_optimizer, comm)
        param_files = self._param_files(config.offload_param,
                                        config.offload_optimizer.chunk_elements, comm)
        self.groups: list[FlatGroup] = []
        for index, (params, names) in enumerate(groups):
            if not params:
                continue
            # stages 2-3 reduce buckets mid-backward, each group on its own
            # channel: see [Note: reduction channels] in _comm.py
            reduce_comm = comm.channel(len(self.groups)) \
                if self.policy.reduces_in_backward else None
            fg = FlatGroup(index, params, names, self.compute_dtype, comm, self.policy,
                           config.reduce_bucket_size, units=self._units(params, owners),
                           device=self.device,
                           grad_dtype=DTYPES[config.grad_accum_dtype or config.precision],
                           offload=offload(index),
                           staged=self._staged, reduce_comm=reduce_comm,
                           param_files=param_files(index))
            for name, fill in fresh_states(optimizer, self._spec,
                                           optimizer.param_groups[index]).items():
                fg.add_state(name, fill)
            self.groups.append(fg)
        self.frozen_group = None
        # [Note: backward lifecycle] in _backward.py
        self._backward = BackwardLifecycle(self.groups) \
            if self.policy.reduces_in_backward else None
        if self.policy.partitions_params:
            # integer parameters (indices, counters) are not cast nor
            # partitioned: kept whole on every rank, as at stages 0-2
            frozen = [(n, p) for n, p in module.named_parameters()
                      if not p.requires_grad and p.is_floating_point()]
            if frozen:
                self.frozen_group = FlatGroup(
                    -1, [p for _, p in frozen], [n for n, _ in frozen], self.compute_dtype,
                    comm, self.policy, config.reduce_bucket_size,
                    units=self._units([p for _, p in frozen], owners), trainable=False,
                    device=self.device, param_files=param_files("frozen"))
            self._schedule = Stage3Schedule(module, self.all_groups, comm, config,
                                            self._backward)
        self._param_groups_seen = len(optimizer.param_groups)
        me = weakref.ref(self)
        for fg in self.all_groups:
            for unit in fg.units:
                for p in unit.params:
                    p._zero_place = Place(fg, unit, self._schedule, me)
        if not self.policy.reduces_in_backward:
            for fg in self.groups:
                if fg.accumulate_by_hook:
                    self._on_each_grad(fg, _accumulate_grad)
        else:
            for fg in self.groups:
                self._on_each_grad(fg, _grad_ready)
            if self._schedule is None:
                self._hook_root_for_backward()
        take_in_optimizer_states(optimizer, self.groups, resumed)
        self._guard_optimizer()
        record_parameters(self.all_groups)

    @property
    def all_groups(self) -> list[FlatGroup]:
        """The trainable groups, and stage 3's group of frozen parameters."""
        return self.groups + ([self.frozen_group] if self.frozen_group else [])

    # ---- construction helpers ----------------------------------------------

    def _cast(self, module):
        """module.to(the engine's device, compute dtype), leaving
        partitioned_init placeholders for the flat groups to gather one at
        a time (casting one would allocate it in full). At stages 0-2 frozen
        parameters are not in a flat group, so a frozen placeholder is
        gathered here."""
        dtype, device = self.compute_dtype, self.device

        def cast(t):
            if sharded_record(t) is not None:
                if self.policy.partitions_params or t.requires_grad:
                    return t
                return take_values(t).to(device=device, dtype=dtype)
            return t.to(device=device, dtype=dtype if t.is_floating_point() else None)
        module._apply(cast)

    def _offload_files(self, offload, comm):
        """group index -> the NvmeFiles its states live in (None: in memory,
        the host's for a staged GPU model)."""
        if offload.device != "nvme":
            return lambda index: None
        from zero.offload._nvme import NvmeFiles
        return lambda index: NvmeFiles(offload.nvme_path, f"r{comm.global_rank}-g{index}",
                                       offload.chunk_elements, offload.write_through)

    @staticmethod
    def _param_files(offload, chunk_elements, comm):
        """group index -> the NvmeFiles its stage-3 shard lives in (None: in
        memory). offload_param "cpu" changes nothing for a CPU model, the
        only kind it is accepted for (initialize). The step writes the
        shard chunk by chunk, offload_optimizer's chunk_elements at a time."""
        if offload.device != "nvme":
            return lambda index: None
        from zero.offload._nvme import NvmeFiles
        return lambda index: NvmeFiles(offload.nvme_path, f"r{comm.global_rank}-g{index}-params",
                                       chunk_elements, what="offload_param")

    @staticmethod
    def _owners(module, leaf_modules=()):
        """Parameter id -> (index of the module whose unit holds it, the
        index of the first module that registers it, its place there):
        stage 3 makes one unit of each module's parameters, and one of all
        the parameters below a leaf module (stage3_leaf_modules)."""
        modules = list(module.modules())
        position = {id(m): i for i, m in enumerate(modules)}
        leaf_of = leaf_roots(module, leaf_modules)
        owners = {}
        for m_index, m in enumerate(modules):
            unit_index = position[id(leaf_of[id(m)])] if id(m) in leaf_of else m_index
            for p_index, p in enumerate(m._parameters.values()):
                if p is not None and id(p) not in owners:
                    owners[id(p)] = (unit_index, m_index, p_index)
        return owners

    @staticmethod
    def _units(params, owners):
        """Index lists of params, one per owning module, in module order."""
        if owners is None:
            return None
        order = sorted(range(len(params)), key=lambda i: owners[id(params[i])])
        units = []
        for i in order:
            if units and owners[id(params[units[-1][0]])][0] == owners[id(params[i])][0]:
                units[-1].append(i)
            else:
                units.append([i])
        return units

    @staticmethod
    def _match_param_groups(module, optimizer):
        """The optimizer's groups as (params, names), trainable params only,
        each once; every trainable parameter must be in a group."""
        names = parameter_names(module)
        seen = set()
        groups = []
        for gi, group in enumerate(optimizer.param_groups):
            params, pnames = [], []
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(f"param group {gi} of the optimizer holds a parameter of "
                                     f"shape {tuple(p.shape)} that is not in the model")
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                params.append(p)
                pnames.append(names[id(p)])
            groups.append((params, pnames))
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                raise ValueError(f"parameter '{name}' requires grad but is in none of the "
                                 "optimizer's param groups; add it, or set requires_grad=False")
        shared = first_shared_pair((f"parameter '{name}'", memory_span(p))
                                   for name, p in module.named_parameters())
        if shared is not None:
            raise shared_memory_error(*shared, "Tie them as one Parameter (model.b = model.a)")
        return groups

    def _hook_root_for_backward(self):
        """Stage 2: a backward begins at the root module's output (its
        gradient is the first computed), so every rank finishes every
        backward, even one whose backward reaches none of its trainable
        parameters (it then reduces zeros: the collectives stay matched);
        a backward that raised is abandoned at the next forward. (Stage 3's
        schedule hooks every module, the root among them.)"""
        me = weakref.ref(self)
        self._hooks.append(self.module.register_forward_pre_hook(ModuleHook(
            lambda _m, _a: call_alive(me, Engine._abandon_unfinished_backward))))
        self._hooks.append(self.module.register_forward_hook(ModuleHook(
            lambda _m, _a, output: call_alive(me, Engine._watch_root_output, output))))

    def _watch_root_output(self, output):
        self._backward.watch_output(output)

    def _abandon_unfinished_backward(self):
        """A backward that raised never reached its end: drop what it left."""
        if self._backward is not None:
            self._backward.abandon_if_unfinished()

    def _on_each_grad(self, fg, body):
        """body(engine, fg, i) once parameter i of fg has its gradient
        accumulated. The hook holds the engine and fg weakly: torch keeps a
        parameter's hooks where Python's garbage collector does not look, so
        a strong reference would keep a dropped engine, its buffers and its
        offload files until exit."""
        me, group = weakref.ref(self), weakref.ref(fg)
        for i, p in enumerate(fg.params):
            def hook(_p, i=i):
                target = group()
                if target is not None:
                    call_alive(me, body, target, i)
            self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _guard_optimizer(self):
        """optimizer.step() is refused; optimizer.zero_grad() is the
        engine's, so it also drops gradients stages 2-3 reduced already (a
        discarded backward would otherwise still be applied). torch has no
        zero_grad hook: the optimizer object gets an attribute of its own,
        removed by close()."""
        me = weakref.ref(self)

        def refuse(*_args, **_kwargs):
            if me() is not None:  # a dropped engine leaves the optimizer to the user
                raise RuntimeError("this optimizer is driven by a zero Engine: call "
                                   "engine.step(), not optimizer.step()")
        self._hooks.append(self.optimizer.register_step_pre_hook(refuse))
        release = getattr(self.optimizer, "_release_buffers", None)
        if release is not None:
            release()
        self.optimizer.zero_grad = EngineZeroGrad(self)
        self._hooks.append(AttributeRemoval(self.optimizer, "zero_grad"))
        # its states are the engine's now, partitioned: the optimizer's own
        # state_dict() would hold none (or stale ones), and a load would
        # change nothing the engine uses
        for name in ("state_dict", "load_state_dict"):
            setattr(self.optimizer, name, refuse_states_call(name))
            self._hooks.append(AttributeRemoval(self.optimizer, name))
        # model.zero_grad() too: at stages 2-3 the parameters' .grad are
        # already None after a backward, so torch's alone would drop nothing
        self.module.zero_grad = types.MethodType(model_zero_grad, self.module)
        self._hooks.append(AttributeRemoval(self.module, "zero_grad"))
        # and a submodule's, which drops its own parameters' gradients: at
        # stages 2-3 they were reduced into the partitions already
        for sub in self.module.modules():
            if sub is not self.module and next(sub.parameters(), None) is not None:
                sub.zero_grad = types.MethodType(submodule_zero_grad, sub)
                self._hooks.append(AttributeRemoval(sub, "zero_grad"))

    def _check_optimizer_unchanged(self):
        """The engine laid out its partitions and states for the optimizer's
        groups and the trainable parameters as they were at initialize: a
        change since would be ignored silently, so it is refused."""
        groups = self.optimizer.param_groups
        if len(groups) != self._param_groups_seen:
            raise RuntimeError(
                f"the optimizer has {len(groups)} param groups, but had "
                f"{self._param_groups_seen} at zero.initialize (add_param_group after "
                "initialize): the engine partitions only the groups it was given. Call "
                "zero.initialize again with the optimizer as it is now")
        for fg in self.groups:
            missing = set(self._spec.states(groups[fg.index])) - set(fg.states)
            if missing:
                raise ValueError(
                    f"param group {fg.index} now needs optimizer state {sorted(missing)} "
                    "(amsgrad or momentum turned on after zero.initialize), which the engine "
                    "did not allocate: set it before initialize, or call zero.initialize again")
        for name, p in self.module.named_parameters():
            place = getattr(p, "_zero_place", None)
            trained = place is not None and place.engine() is self and place.fg.trainable
            if p.requires_grad and not trained and p.is_floating_point():
                raise RuntimeError(
                    f"parameter '{name}' requires grad, but was frozen (or not in the model) at "
                    "zero.initialize, so the engine does not train it. Call zero.initialize "
                    "again after changing which parameters train")
            if trained and not p.requires_grad:
                raise RuntimeError(
                    f"parameter '{name}' was set to requires_grad=False after zero.initialize; "
                    "the engine would still update it. Call zero.initialize again after "
                    "changing which parameters train")

    # ---- training API ---------------------------------------------------------

    def _check_update_arguments(self):
        """Every group's settings as the update will take them, checked
        before the first group is updated: a later group's refusal would
        otherwise leave the step half applied."""
        for fg in self.groups:
            try:
                _step_path.check_update_arguments(
                    self._spec, self.optimizer, self.optimizer.param_groups[fg.index],
                    fg.step_count + 1)
            except (ValueError, TypeError) as error:
                raise type(error)(f"optimizer param group {fg.index}: {error}; nothing was "
                                  "updated") from None

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this engine was closed (close(), or zero.initialize was called "
                               "again on its model): train with the engine zero.initialize "
                               "returned last; a closed engine's model is a plain torch "
                               "model (model.state_dict(), torch.save)")

    def forward(self, *args, **kwargs):
        self._check_open()
        check_parameters_in_place(self.all_groups)
        cast = lambda x: x.to(self.compute_dtype) if torch.is_tensor(x) and \
            x.is_floating_point() else x  # noqa: E731
        args = tuple(cast(a) for a in args)
        kwargs = {k: cast(v) for k, v in kwargs.items()}
        return self.module(*args, **kwargs)

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler else 1.0

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True):
        """loss.backward(retain_graph=...), with the fp16 loss scale
        applied. With bf16 and fp32, plain loss.backward() is the same.
        Several backwards before a step() add up, at every stage (a second
        one through a graph kept by retain_graph=True, or another loss).
        The step averages the gradient_accumulation_steps micro-batches
        (see "Averaging" in docs/engine.md); scale_wrt_gas=False, as
        DeepSpeed's, keeps this loss's gradient whole: the loss is
        multiplied by the count the step divides by."""
        self._check_open()
        for name, value in (("retain_graph", retain_graph), ("scale_wrt_gas", scale_wrt_gas)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        factor = self.loss_scale if self.loss_scaler else 1.0
        if not scale_wrt_gas:
            factor *= self.config.gradient_accumulation_steps
        (loss * factor if factor != 1.0 else loss).backward(retain_graph=retain_graph)
        # only once it finished: a backward that raised leaves unscaled
        # partial gradients, which zero_grad() drops
        self._scaled_backward = True

    @property
    def is_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-steps inside do not count toward the accumulation boundary:
        gradients accumulate locally and engine.step() does nothing. Stages
        2 and 3 reduce every backward, so they refuse (as DeepSpeed does)."""
        if self.policy.reduces_in_backward:
            raise RuntimeError(f"no_sync() cannot be used with stage {self.stage}: its "
                               "gradients are reduced during every backward")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def _prepare_boundary(self):
        """Reduce the gradients and take the global squared norm (once)."""
        if self._prepared is not None:
            return self._prepared
        for fg in self.groups:
            if not self.policy.reduces_in_backward:
                fg.gather_stray_grads()
                fg.reduce_full()
            elif not fg.reduced_since_step:
                # No backward reached this rank's hooks since the last step:
                # still issue the collectives the other ranks issue (this
                # covers one backward per step; see docs/engine.md).
                fg.reducer.finish_backward()
            fg.reduced_since_step = False
            fg.reduce_across_replicas()
        sumsq = self.step_path.squared_norm(self.groups, self._comm,
                                            across_ranks=self.policy.partitions)
        base = 1.0 / (self.loss_scale * self._comm.dp_world *
                      self.config.gradient_accumulation_steps)
        # a NaN gradient gives a NaN norm, as torch's clip_grad_norm_ does
        norm = math.sqrt(sumsq) * base if math.isfinite(sumsq) else abs(sumsq)
        self._prepared = (sumsq, norm, base)
        return self._prepared

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the coming update to max_norm (global L2 norm over all shards)
        and return the norm before clipping. Call after the backward of the
        boundary micro-batch, before step(). A collective: every rank must
        call it."""
        self._check_open()
        refusal = None
        if not max_norm > 0:
            refusal = ValueError(f"max_norm must be > 0, got {max_norm}")
        elif not self.is_accumulation_boundary:
            refusal = RuntimeError(
                "clip_grad_norm_ reduces the gradients: call it only after the backward of "
                f"the last micro-batch of an accumulation boundary (micro-step "
                f"{self.micro_steps + 1} of {self.config.gradient_accumulation_steps})")
        # the reduction below would meet whatever the other ranks do next
        take_in_parameter_writes(self.all_groups, self.call_text("clip_grad_norm_()"), refusal)
        self._clip_norm = float(max_norm)
        return self._prepare_boundary()[1]

    def call_text(self, call: str) -> str:
        """`call` with this engine's counts, as the ranks compare it
        ([Note: writes agreed] in _step_agreement.py)."""
        return f"{call} at update {self.global_steps}, micro-step {self.micro_steps}"

    def step(self):
        """At the accumulation boundary: reduce the gradients over the
        ranks, clip (gradient_clipping, or clip_grad_norm_'s max_norm),
        update this rank's partition (fp16: skipped on overflow), gather the
        new parameters, step the lr scheduler and zero the gradients.
        Before it, only counts the micro-step. A collective: every rank
        calls it as often; what would refuse the step on one rank refuses
        it on every rank, before anything changes."""
        self._check_open()
        self._step_applied = False  # until a boundary's update is applied
        unscaled = None
        if self.loss_scaler is not None and not self._scaled_backward:
            # the gradients would be divided by a scale the loss never had
            unscaled = RuntimeError(
                "fp16: step() needs an engine.backward(loss) since the last step() or "
                "zero_grad(): a plain loss.backward() does not multiply the loss by the loss "
                "scale, which step() divides the gradients by")
        boundary = self.is_accumulation_boundary and not self._in_no_sync
        if unscaled is not None and not boundary:
            raise unscaled  # no collective here; the counts differ at the next one
        if self._in_no_sync:
            self._scaled_backward = False
            return
        if boundary:
            # everything that can refuse, before anything changes, and
            # agreed over the ranks: a refusal on one rank alone, or settings
            # changed on one rank alone, stop every rank ([Note: writes agreed])
            refusal, settings = unscaled, ""
            try:
                if refusal is None:
                    self._check_optimizer_unchanged()
                    self._check_update_arguments()
                if self._comm.dp_world > 1:  # compared over every data-parallel rank
                    settings = describe_settings(self.optimizer.param_groups,
                                                 [fg.index for fg in self.groups])
            except (RuntimeError, ValueError, TypeError) as error:
                refusal = error
            # the zero_grad() calls since the last update too: one made on
            # some ranks only drops gradients there alone (at stages 2-3
            # from that rank's partition: half the model then steps on the
            # average, the rest on nothing)
            call = self.call_text(f"step() after {self._zero_grad_calls} zero_grad() calls")
            take_in_parameter_writes(self.all_groups, call, refusal, settings)
        self._scaled_backward = False
        self.micro_steps += 1
        if not boundary:
            return
        sumsq, norm, base = self._prepare_boundary()
        with interrupts_held():  # the update and its bookkeeping: whole, or not at all
            self._apply_boundary(sumsq, norm, base)

    def _apply_boundary(self, sumsq, norm, base):
        """step()'s part from the reduced gradients on: skip or update, gather
        the parameters, count the step, move the schedule, zero the
        gradients."""
        max_norm = self._clip_norm or self.config.gradient_clipping
        self._prepared, self._clip_norm = None, None
        overflow = not math.isfinite(sumsq)
        self.step_was_skipped = overflow and (self.loss_scaler is not None or
                                              self.config.check_grad_overflow)
        if self.step_was_skipped:
            self.skipped_steps += 1
            if self.loss_scaler:
                self.loss_scaler.update(True)
        else:
            if self.loss_scaler:
                self.loss_scaler.update(False)
            coef = clip_coefficient(max_norm, norm)
            for fg in self.groups:
                counted = self._spec.counts_as_step(self.optimizer.param_groups[fg.index])
                fg.step_count += counted
                try:
                    self.step_path.update(self._spec, self.optimizer,
                                          self.optimizer.param_groups[fg.index], fg, base * coef)
                except BaseException:
                    # a refusal comes before anything changes; a failure in
                    # the middle of a chunked update (files, offload_param)
                    # leaves it partly applied (docs/offload.md)
                    fg.step_count -= counted
                    raise
                fg.all_gather_params()
                # autograd then refuses a backward through a graph that
                # saved the old values, as after torch.optim's step
                bump_versions(fg)
            self.global_steps += 1
            # The engine stepped on the optimizer's behalf; torch's schedulers
            # read this flag to warn about stepping before the optimizer.
            self.optimizer._opt_called = True
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        self._step_applied = not self.step_was_skipped
        self._global_grad_norm = norm
        self.zero_grad()
        self._zero_grad_calls = 0
        self._last_comm = self._comm.log.summary()
        if self._schedule is not None:
            self._last_comm["stage3_gathers"] = self._schedule.take_counts()
        self._comm.log.reset()
        replicate = self._comm.replicate
        if replicate is not None:  # hybrid sharding: what crossed the replicas
            self._last_comm["dp_replicate"] = replicate.log.summary()
            replicate.log.reset()

    def zero_grad(self, set_to_none: bool = True):
        """Zero the gradients (they stay views of the flat buffers). After a
        backward that raised, this also drops what that backward left in
        flight, so none of it is added in later. optimizer.zero_grad()
        comes here too."""
        self._check_open()
        self._zero_grad_calls += 1  # agreed at the step: see step()
        self._abandon_unfinished_backward()
        # a norm taken of the dropped gradients must not clip the next step
        self._prepared, self._clip_norm = None, None
        self._scaled_backward = False
        for fg in self.groups:
            fg.zero_grads()
            if fg.grad_flat is not None:
                fg.point_grads_at_flat()

    def _zero_grads_of(self, params):
        """A submodule's zero_grad(): drop these parameters' gradients."""
        self._check_open()
        self._zero_grad_calls += 1
        wanted = {id(p) for p in params}
        for fg in self.groups:
            members = {i for i, p in enumerate(fg.params) if id(p) in wanted}
            if members:
                fg.zero_grads_of(members)

    def register_external_parameter(self, module: nn.Module, param: nn.Parameter):
        """Stage 3: make `module`'s forward (and backward) gather `param`,
        which the module uses without registering it (a parent that calls
        F.linear(x, self.embed.weight) itself). Without this such a read
        finds the released placeholder. Every rank must register the same.
        A no-op at stages 0-2, where parameters are always gathered."""
        if self._schedule is not None:
            self._schedule.add_external(module, param)

    # ---- reporting --------------------------------------------------------------

    def memory_summary(self) -> MemorySummary:
        """This rank's model-state bytes. At stage 3, `params` is the shard
        plus the persistent units, and `gathered_peak` the most bytes of
        released units gathered at once (current module plus prefetch).
        A closed engine holds nothing: its figures would be stale."""
        self._check_open()
        totals = {"params": 0, "grads": 0, "optimizer_states": 0, "offloaded": 0, "host": 0,
                  "buckets": 0, "persistent": 0, "params_offloaded": 0}
        for fg in self.groups:
            for k, v in fg.nbytes().items():
                totals[k] += v
        item = self.compute_dtype.itemsize
        totals["gathered_peak"] = self._schedule.peak_live * item if self._schedule else 0
        grouped = {id(p) for fg in self.all_groups for p in fg.params}
        frozen = 0
        if self.frozen_group is not None:
            frozen_bytes = self.frozen_group.nbytes()
            frozen = frozen_bytes["params"]
            totals["params_offloaded"] += frozen_bytes["params_offloaded"]
        frozen += sum(p.nbytes for p in self.module.parameters() if id(p) not in grouped)
        totals["model_states"] = totals["params"] + totals["grads"] + \
            totals["optimizer_states"] + totals["gathered_peak"]
        totals["frozen_params"] = frozen
        formula, expected = self._formula(totals)
        return MemorySummary(totals, formula=formula, formula_bytes=expected,
                             world_size=self._comm.world, stage=self.stage,
                             trainable_params=sum(fg.numel for fg in self.groups))

    def _formula(self, totals):
        return zero_formula(
            self.stage, self._comm.world, self.compute_dtype.itemsize,
            self.groups[0].grad_part.element_size(),  # grad_accum_dtype's
            self.compute_dtype != torch.float32 or self._staged,  # a master of its own
            [(fg.numel, len(fg.states)) for fg in self.groups], totals)

    def comm_summary(self) -> dict:
        """Elements and bytes per collective in the last optimizer step; at
        stage 3 also how many unit gathers were prefetched and how many
        waited on demand ("stage3_gathers"). With hybrid sharding the
        top-level figures are the partitions' group's (dp_shard) and
        "dp_replicate" holds what was summed across the replicas."""
        return self._last_comm

    def module_state_entries(self) -> dict:
        """The model's state_dict(keep_vars=True), for its names and
        buffers: at stage 3 the released parameters in it are placeholders
        (which a user's state_dict() call warns about)."""
        if self._schedule is None:
            return self.module.state_dict(keep_vars=True)
        self._schedule.reading_state = True
        try:
            return self.module.state_dict(keep_vars=True)
        finally:
            self._schedule.reading_state = False

    def full_state_dict(self) -> dict:
        """The whole model's state dict, trainable parameters in fp32 from
        the master copies (gathered from every rank), on every rank, in host
        memory whatever the model's device. A collective: every rank must
        call it."""
        self._check_open()
        take_in_parameter_writes(self.all_groups, self.call_text("full_state_dict()"))
        full = {}
        by_id = {}
        for fg in self.all_groups:
            master = fg.gather_master()
            fg.release_offloaded()
            for i, p in enumerate(fg.params):
                by_id[id(p)] = fg.view(master, i).clone()
        for name, t in self.module_state_entries().items():
            if id(t) in by_id:
                full[name] = by_id[id(t)]
            else:
                t = t.detach()
                full[name] = t.to(device="cpu", copy=True,
                                  dtype=torch.float32 if t.is_floating_point() else None)
        return full

    def save_checkpoint(self, save_dir, tag=None, client_state=None,
                        save_latest: bool = True) -> str:
        """Write this engine's training state to <save_dir>/<tag>/ (tag
        default "global_step<N>"), each rank its own partitions, and name
        the tag in <save_dir>/latest. It loads at any world size and stage
        (load_checkpoint) and into plain torch (zero.checkpoint.consolidate).
        client_state: a dict of your own (tensors, numbers, strings, lists,
        dicts), handed back by load_checkpoint. A collective; call it after
        the boundary's step(). Returns the checkpoint's directory."""
        self._check_open()
        from zero.checkpoint import _engine_io as _checkpoint
        return _checkpoint.save(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict: bool = True, *,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        """Restore a checkpoint of save_checkpoint (tag default: the one in
        <load_dir>/latest): weights, buffers, optimizer states and
        hyperparameters, step counts, the loss scale and the LR scheduler.
        The checkpoint may come from another world size or stage. Everything
        is checked (names, shapes, optimizer kind, files) before anything
        changes. A collective. Returns (checkpoint directory, client_state),
        or (None, None) when load_dir holds no checkpoint yet.
        load_module_strict: DeepSpeed's third argument; only True (the
        architecture must match) is supported."""
        self._check_open()
        if load_module_strict is not True:
            raise ValueError(
                f"load_module_strict={load_module_strict!r}: only True is supported (every "
                "parameter of the checkpoint must match the model's by name and shape). To "
                "fine-tune with a changed head, load the consolidated weights "
                "(zero.checkpoint.consolidate) into the model with "
                "load_state_dict(strict=False) before zero.initialize")
        from zero.checkpoint import _engine_io as _checkpoint
        return _checkpoint.load(self, load_dir, tag, load_optimizer_states,
                                load_lr_scheduler_states, load_module_only)

    def _restore_params(self):
        """Stage 3: give every parameter its full values again, in plain
        tensors of its own, so the model works without the engine (a
        collective)."""
        for fg in self.all_groups:
            for unit in fg.units:
                self._schedule.ensure(fg, unit)
                for p, off, n, shape in zip(unit.params, unit.offsets, unit.numels,
                                            unit.shapes):
                    p.data = unit.full[off:off + n].view(shape).clone()
                unit.gathered = False
                unit.full = None

    def close(self):
        """Hand the model and optimizer back to plain torch: remove the
        engine's hooks; at stage 3 gather every parameter whole again (a
        collective: every rank must call it); give the optimizer its states
        back in one process (on several ranks they stay partitioned, and
        the optimizer refuses what would start them afresh; docs/engine.md);
        free offload files; destroy the in-memory process group made for a
        launcher-less run (an env:// group stays for the next engine in this
        process; see _comm.join_process_group). A second call does nothing."""
        if self._closed:
            return
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._schedule is not None:
            self._schedule.remove()
            self._restore_params()
        give_back_optimizer_states(self.optimizer, self.groups, self._comm.world)
        resume = getattr(self.optimizer, "_resume_after_engine", None)  # zero.optim's
        if resume is not None:
            resume()
        for fg in self.all_groups:
            for p in fg.params:
                p.__dict__.pop("_zero_place", None)
            if fg.offload is not None:  # its windows and descriptors
                fg.offload.close()
            if fg.param_files is not None:
                fg.param_files.close()
        self._leave_group()
        self._closed = True


def clip_coefficient(max_norm, norm) -> float:
    """What the gradients are multiplied by: torch's clip_grad_norm_
    coefficient min(1, max_norm / (norm + 1e-6)), 0 for an inf norm. For
    a NaN norm torch's is NaN, which turns every parameter NaN; the C core
    refuses a NaN scale, so it is 0 as for inf: the NaN elements' own
    parameters become NaN, the other gradients count for nothing that
    step (min() in Python would have given 1.0). docs/engine.md."""
    if not max_norm:
        return 1.0
    if math.isnan(norm):
        return 0.0
    return min(1.0, max_norm / (norm + 1e-6))


def _accumulate_grad(_engine, fg, i):
    fg.accumulate_grad(i)


def _grad_ready(engine, fg, i):
    engine._backward.begin()  # a backward that reached no module output
    fg.reducer.on_grad_ready(i)


def _broadcast_buffer(comm, name, buf, kind="buffer"):
    """Rank 0's value of a buffer on every rank. The collective writes
    numel x itemsize bytes from the data pointer, so a buffer that is not
    contiguous goes through a contiguous copy; one whose elements share
    memory (an expanded tensor) cannot take a value per element at all."""
    comm = comm.everyone  # the replicas take rank 0's value too
    if comm.world == 1:
        return
    if torch._debug_has_internal_overlap(buf) == 1:
        raise ValueError(f"{kind} '{name}' has elements that share memory (an expanded "
                         f"tensor, strides {tuple(buf.stride())}), so rank 0's value cannot "
                         "be written into it; register buf.contiguous() (or clone()) instead")
    if buf.is_contiguous():
        comm.broadcast(buf, src=0)
        return
    staged = buf.contiguous()
    comm.broadcast(staged, src=0)
    buf.copy_(staged)

