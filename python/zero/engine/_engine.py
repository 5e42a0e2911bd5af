"""zero.Engine: the training engine that zero.initialize returns.

It wraps the user's module in place: trainable parameters become views into
flat, partitioned buffers (_flat_group.FlatGroup), gradients are reduced
over ranks with SUM, and the update runs on this rank's partition (the C
core, or on a GPU zero's kernels: _step_path.py) with every scale folded
into one factor:

    grad_scale = clip_coefficient / (loss_scale * world_size * accumulation_steps)

The step at the accumulation boundary: _boundary_step.py ([Note: boundary
step]).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import weakref

import torch
from torch import nn

from zero.config._values import require_bool
from zero.engine._agreement import check_ranks_agree
from zero.comm._channel_room import check_channel_room
from zero.comm._comm import Comm, leave_process_group
from zero._warnings import warn_user
from zero.engine._batch_calls import BatchCalls
from zero.engine._boundary_step import BoundaryStep
from zero.engine._checkpoint_calls import CheckpointCalls
from zero.engine._deepspeed_queries import DeepSpeedQueries, LossScale
from zero.engine._deepspeed_settings import DeepSpeedSettings
from zero.engine._construction import (apply_aio, broadcast_buffer, cast_module,
                                       match_param_groups, offload_files, owners_of,
                                       param_files, units_of, warn_if_narrowed,
                                       kept_buffers, note_kept_buffers,
                                       refuse_shared_element_buffers)
from zero.engine._generation import route_generate
from zero.engine._handback import forget_dropped, hand_back, record_dtypes, undo_failed_build
from zero.sharding._failed_build import give_back_released
from zero.engine._reports import EngineReports
from zero.engine._module_attributes import ModuleAttributes
from zero.engine._not_copied import NotCopied
from zero.engine._script_grad_hooks import warn_of_script_post_accumulate_hooks
from zero.engine._routes import (call_alive, guard_optimizer, mark_every_rank_runs_every_layer,
                                 on_each_grad)
from zero.engine._unchanged import frozen_in_optimizer, group_members
from zero.sharding._copying import ModuleHook, note_whole_graph_refused
from zero.sharding._external import remember_external
from zero.sharding._flat_group import FlatGroup
from zero.sharding._groups_together import ReductionChannels
from zero.sharding._outputs import map_tensors
from zero.offload import _param_staging
from zero.engine._monitor import Monitor
from zero.step._loss_scaler import DynamicLossScaler
from zero.step._registry import fresh_states, spec_for
from zero.sharding._ds_attributes import mark_partitioned
from zero.sharding._param_marks import mark
from zero.sharding._param_writes import Place, check_parameters_in_place, record_parameters
from zero.step._resumed_states import (describe_held, held_optimizer_states,
                                       take_in_optimizer_states)
from zero.sharding._backward import BackwardLifecycle
from zero.sharding._policy import StagePolicy
from zero.sharding._stage3 import Stage3Schedule
from zero.sharding._unit_roots import unit_roots
from zero.sharding._units import written_in_forward
from zero.step import _step_path
from zero.step._delayed import delayed_update_for
from zero.step._step_path import check_settings_at_initialize, step_path_for
from zero.config._config import DTYPES, Config

_SERIALS = collections.defaultdict(itertools.count)  # Engine.serial by the ranks


class Engine(BoundaryStep, DeepSpeedQueries, DeepSpeedSettings, BatchCalls, CheckpointCalls,
             EngineReports, NotCopied, ModuleAttributes, nn.Module):
    """What zero.initialize returns: the model wrapped for ZeRO training.
    Call it as the model (inputs are cast to the compute dtype), then
    engine.backward(loss) and engine.step(). Its attributes: module,
    optimizer, config, lr_scheduler, stage, global_steps, micro_steps.
    docs/engine.md describes it all."""

    def __init__(self, module: nn.Module, optimizer, config: Config, comm: Comm,
                 owns_group: bool, lr_scheduler=None, tensor_parallel=None, pipeline=None,
                 inference: bool = False):
        super().__init__()
        # zero.inference's: every parameter frozen, no optimizer to step
        self.inference_only = inference
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.lr_scheduler = lr_scheduler
        self._comm = comm
        # a parallel/_tensor_parallel.TensorParallelLayout, or None
        self._tensor_parallel = tensor_parallel
        # a parallel/_pipeline.PipelineLayout: this rank's pipeline stage
        self._pipeline = pipeline
        # a parallel/_mpu.MegatronParallel: a model split by hand, Megatron's way
        self._mpu = None
        self._spec = spec_for(optimizer)
        check_settings_at_initialize(optimizer)
        self.compute_dtype = DTYPES[config.precision]
        self.device = comm.device  # the model's; every buffer lives there
        # chosen before any hook is installed: a failure leaves no trace
        self._staged = _step_path.states_off_device(self.device, config.offload_optimizer)
        self.step_path = _step_path.StagedHostStep(self.device) if self._staged \
            else step_path_for(self.device)
        # [Note: parameters off the device] in _param_staging.py
        self._copier = _param_staging.ShardCopier(self.device) \
            if _param_staging.params_off_device(self.device, config.offload_param) else None
        # [Note: delayed update] in step/_delayed.py
        self._delayed = delayed_update_for(config.offload_optimizer, self._staged,
                                           self.step_path, self.device)
        self.stage = config.stage
        self.policy = StagePolicy.of(config.stage)
        # the engines made over these ranks, in order (the same on each: a
        # collective), in each agreed call: ranks calling two engines in
        # other orders raise instead of pairing them
        self.serial = next(_SERIALS[tuple(comm.everyone.global_ranks)])
        self.micro_steps = 0
        self.global_steps = 0
        self.step_was_skipped = False
        self._step_applied = False  # was_step_applied(): DeepSpeed's meaning
        self.skipped_steps = 0  # fp16 steps skipped on overflow (DeepSpeed's name)
        self._scaled_backward = False
        self._in_no_sync = False
        self._zero_grad_calls = 0  # since the last update
        self._backwards = 0  # engine.backward()s since the last update at stages 0-1
        self._prepared = None  # (sumsq, norm) once the boundary's reduction ran
        self._clip_norm = None
        self._hooks = []
        self._last_comm = comm.log.summary()
        self._closed = False
        self.loss_scaler = DynamicLossScaler(config.loss_scaling) \
            if config.precision == "fp16" else None
        # [Note: monitor events] in _monitor.py: written by global rank 0
        self._monitor = Monitor(config.monitor) if config.monitor and comm.global_rank == 0 \
            else None

        # what can be refused is refused before the model is changed
        groups = match_param_groups(module, optimizer)
        # [Note: units by block] in sharding/_unit_roots.py
        self._unit_roots = unit_roots(module, config.units, config.stage3_leaf_modules) \
            if self.policy.partitions_params else None
        owners = owners_of(module, self._unit_roots) if self._unit_roots else None
        if not any(params for params, _names in groups) and not inference and \
                getattr(module, "_zero_pipeline", None) is not None:
            raise ValueError("this pipeline stage has no trainable parameters (every parameter "
                             "has requires_grad=False): a stage that trains nothing is not "
                             "supported under a pipeline schedule yet. Keep a parameter of "
                             "each stage trainable, or freeze less of the model's front")
        if not any(params for params, _names in groups) and not inference:
            raise ValueError("the model has no trainable parameters (every parameter has "
                             "requires_grad=False); nothing to train. To run it partitioned "
                             "without training (a reference or reward model, generation), "
                             "use zero.inference(model, stage=3)")
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
        except BaseException as error:
            for h in self._hooks:
                h.remove()
            if self._schedule is not None:
                self._schedule.remove()
            if self.policy.releases_params:
                # [Note: a failed stage-3 build gives back] where the rank
                # holds every value; the rest hold none now: said to the
                # next initialize instead of training empty placeholders
                built = list(getattr(self, "groups", []))
                if getattr(self, "frozen_group", None) is not None:
                    built.append(self.frozen_group)
                for fg in built:
                    give_back_released(fg)
            undo_failed_build(self, module, error)
            for p in module.parameters():
                if p.numel() == 0 and self.policy.releases_params:
                    mark(p, "_zero_lost", True)
            raise
        # registered last: a failed __init__ leaves through initialize's
        # error path, not here too. A dropped engine leaves its group (a
        # notebook that rebinds `engine` without close() kept the in-memory
        # group for good); close() runs it at once, and it runs only once.
        self._leave_group = weakref.finalize(self, leave_process_group, owns_group)
        route_generate(self)  # [Note: the model's own generate at stage 3]

    def _build(self, module, optimizer, config, comm, groups, owners, resumed):
        # the engine's gradients start at zero: a .grad left by a torch run
        # (its loop zeroes before backward) would otherwise join the first
        # step at stages 2-3 and be dropped at 0-1
        for params, _names in groups:
            for p in params:
                p.grad = None
        refuse_shared_element_buffers(module)
        self._dtypes_before = record_dtypes(module)  # [Note: dtypes given back]
        warn_if_narrowed(self._dtypes_before, self.compute_dtype)
        cast_module(module, self.compute_dtype, self.device, self.policy,
                    config.buffer_dtype and DTYPES[config.buffer_dtype])
        self._kept_buffers = kept_buffers(module, self.compute_dtype)
        for name, buf in module.named_buffers():
            broadcast_buffer(comm, name, buf)
        # parameters outside the flat groups (which broadcast their own):
        # frozen ones at stages 0-2, integer ones at stage 3
        with torch.no_grad():
            for name, p in module.named_parameters():
                if not p.requires_grad and \
                        (not self.policy.partitions_params or not p.is_floating_point()):
                    broadcast_buffer(comm, name, p.data, kind="parameter")
        apply_aio(config.aio, config.offload_optimizer, config.offload_param)
        offload = offload_files(config.offload_optimizer, comm)
        shard_files = param_files(config.offload_param,
                                  config.offload_optimizer.chunk_elements, comm)
        channels = None
        if self.policy.reduces_in_backward:
            # stages 2-3 reduce buckets mid-backward, each group on its own
            # channel but the small groups', which share one ([Note:
            # reduction channels] in _comm.py; [Note: small groups'
            # buckets] in _buckets.py); room for them first ([Note: channel room])
            channels = ReductionChannels(
                comm, [(params, units_of(params, owners)) for params, _names in groups if params],
                config.reduce_bucket_size, config.bucket_reduction,
                comm.world if self.policy.partitions else 1)
            check_channel_room(comm, sum(1 for params, _names in groups if params),
                               self.policy.stage, channels.count)
        self.groups: list[FlatGroup] = []
        for index, (params, names) in enumerate(groups):
            if not params:
                continue
            reduce_comm = comm.channel(channels.channel[len(self.groups)]) \
                if channels is not None else None
            fg = FlatGroup(index, params, names, self.compute_dtype, comm, self.policy,
                           config.reduce_bucket_size, units=units_of(params, owners),
                           device=self.device,
                           grad_dtype=DTYPES[config.grad_accum_dtype or config.precision],
                           offload=offload(index),
                           staged=self._staged, reduce_comm=reduce_comm,
                           bucket_reduction=config.bucket_reduction,
                           param_files=shard_files(index), copier=self._copier,
                           delayed=self._delayed)
            self.groups.append(fg)  # first: a failure below gives its values back
            for name, fill in fresh_states(optimizer, self._spec,
                                           optimizer.param_groups[index]).items():
                fg.add_state(name, fill)
        self.frozen_group = None
        if channels is not None:  # [Note: small groups' buckets] in _buckets.py
            channels.defer(self.groups)
        # [Note: backward lifecycle] in _backward.py
        self._backward = BackwardLifecycle(self.groups, self.serial,
                                           _boundary_of(weakref.ref(self))) \
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
                    units=units_of([p for _, p in frozen], owners), trainable=False,
                    device=self.device, param_files=shard_files("frozen"),
                    copier=self._copier)
            self._schedule = Stage3Schedule(module, self.all_groups, comm, config, self.serial,
                                            self._backward, self._unit_roots)
        self._param_groups_seen = len(optimizer.param_groups)
        self._group_members_seen = group_members(optimizer.param_groups)  # _unchanged.py
        self._frozen_in_optimizer = frozen_in_optimizer(optimizer.param_groups, module)
        self._params_at_initialize = frozenset(map(id, module.parameters()))
        renormed = written_in_forward(module)  # named when the ranks' writes differ
        for fg in self.all_groups:
            fg.renormed_in_forward = renormed
        me = weakref.ref(self)
        for fg in self.all_groups:
            for unit in fg.units:
                for p in unit.params:
                    mark(p, "_zero_place", Place(fg, unit, self._schedule, me))
        if self._schedule is not None:
            mark_partitioned(self.all_groups)  # [Note: DeepSpeed's parameter attributes]
        if not self.policy.reduces_in_backward:
            for fg in self.groups:
                if fg.accumulate_by_hook:
                    on_each_grad(self, fg, _accumulate_grad)
        else:
            for fg in self.groups:
                # the hooks are C ([Note: the hook in C]); they hold the
                # reducer weakly, and do nothing once it is detached
                fg.reducer.on_backward_began = self._backward.begin
                for i, p in enumerate(fg.params):
                    self._hooks.append(p.register_post_accumulate_grad_hook(fg.reducer.hook(i)))
            # [Note: the script's post-accumulate hooks]
            self._script_hooks_named = self._script_hooks_checked = False
            warn_of_script_post_accumulate_hooks(self)
            if self._schedule is None:
                self._hook_root_for_backward()
        dropped = weakref.finalize(self, forget_dropped, self._hooks, self.all_groups,
                                   self._schedule is None, self._schedule)
        dropped.atexit = False  # at exit nothing trains on
        take_in_optimizer_states(optimizer, self.groups, resumed)
        guard_optimizer(self)
        if self._schedule is not None and self._comm.world > 1:
            mark_every_rank_runs_every_layer(self)
        record_parameters(self.all_groups)
        # what a step with no gradient since finds unchanged (a warning)
        self._gradients_at_zero = self.gradient_marks()

    @property
    def all_groups(self) -> list[FlatGroup]:
        """The trainable groups, and stage 3's group of frozen parameters."""
        return self.groups + ([self.frozen_group] if self.frozen_group else [])

    # ---- construction helpers ----------------------------------------------

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

    # ---- training API ---------------------------------------------------------

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this engine was closed (close(), or zero.initialize was called "
                               "again on its model): train with the engine zero.initialize "
                               "returned last; a closed engine's model is a plain torch "
                               "model (model.state_dict(), torch.save)")

    def forward(self, *args, **kwargs):
        self._check_open()
        check_parameters_in_place(self.all_groups)
        cast = lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t  # noqa: E731
        # nested ones too (dicts, lists, tuples, namedtuples, dataclasses);
        # a bare tensor, the usual argument, without the walk
        args = tuple(cast(a) if torch.is_tensor(a) else map_tensors(cast, a) for a in args)
        kwargs = {k: cast(v) if torch.is_tensor(v) else map_tensors(cast, v)
                  for k, v in kwargs.items()}
        if self._monitor is not None:  # the flops profiler starts with a step's first forward
            self._monitor.before_forward(self)
        try:
            return self.module(*args, **kwargs)
        except RuntimeError as error:
            note_kept_buffers(error, getattr(self, "_kept_buffers", []), self.compute_dtype)
            note_whole_graph_refused(error)
            raise

    @property
    def loss_scale(self) -> float:  # callable too, as DeepSpeed's method
        return LossScale(self.loss_scaler.scale if self.loss_scaler else 1.0)

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
        self._check_trains("backward")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a torch.Tensor, got {type(loss).__name__} {loss!r}")
        require_bool(retain_graph, "retain_graph")
        require_bool(scale_wrt_gas, "scale_wrt_gas")
        factor = self.loss_scale if self.loss_scaler else 1.0
        if not scale_wrt_gas:
            factor *= self.config.gradient_accumulation_steps
        (loss * factor if factor != 1.0 else loss).backward(retain_graph=retain_graph)
        self._backwards += 1
        if self._monitor is not None:
            self._monitor.record_loss(loss)
        # only once it finished: a backward that raised leaves unscaled
        # partial gradients, which zero_grad() drops
        self._scaled_backward = True

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-steps inside do not count toward the accumulation boundary:
        gradients accumulate locally and engine.step() does nothing. Stages
        2 and 3 reduce every backward, so they refuse (as DeepSpeed does)."""
        if self.policy.reduces_in_backward:
            raise RuntimeError(f"no_sync() cannot be used with stage {self.stage}: its "
                               "gradients are reduced into the partitions during every "
                               "backward (as DeepSpeed's). To accumulate, leave no_sync() "
                               "out: backward() several times, then step(), sums the "
                               "gradients at every stage (or set gradient_accumulation_steps "
                               "and call step() after each backward)")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def _check_trains(self, call: str):
        if self.inference_only:
            raise RuntimeError(f"{call}(): this engine was made by zero.inference, which "
                               "trains nothing (its parameters are frozen and it has no "
                               "optimizer); use zero.initialize to train")

    def call_text(self, call: str) -> str:
        """`call` with this engine's counts, as the ranks compare it
        ([Note: writes agreed] in _step_agreement.py)."""
        return f"{call} of engine {self.serial} at update {self.global_steps}, micro-step " \
            f"{self.micro_steps}"

    def _apply(self, fn, recurse=True):
        """engine.to(...), .half(), .cuda(), .to_empty(...) go through here
        (nn.Module's). The engine's parameters live in its buffers on its
        device and in its compute dtype: a move or cast replaced them with
        tensors the engine does not know (a meta device lost every value,
        and the next forward ended in torch's device error). Refused
        before anything changes; a call that changes nothing goes on."""
        seen = set()
        for p in self.module.parameters():
            kind = (p.dtype, p.device)
            if kind in seen:
                continue
            seen.add(kind)
            out = fn(torch.empty(0, dtype=p.dtype, device=p.device))
            if isinstance(out, torch.Tensor) and (out.dtype, out.device) != kind:
                raise RuntimeError(
                    f"this would move or cast the engine's parameters ({p.dtype} on "
                    f"{p.device} -> {out.dtype} on {out.device}), which live in its buffers "
                    "and partitions: nothing was changed. Choose the device and the compute "
                    "dtype at zero.initialize (device=, precision=), or close() the engine "
                    "first (the model is a plain one then)")
        return super()._apply(fn, recurse)

    def zero_grad(self, set_to_none: bool = True):
        """Zero the gradients. set_to_none is taken for torch's signature
        and not followed: at stages 0-1 each .grad is a view of the flat
        gradient buffer, zeroed in place and kept; at stages 2-3 .grad is
        None (the gradients are in the buckets and partitions). After a
        backward that raised, this also drops what that backward left in
        flight, so none of it is added in later. optimizer.zero_grad()
        comes here too."""
        self._check_open()
        self._zero_grad_calls += 1  # agreed at the step: see step()
        # the gradients of the backwards counted so far are gone: the step
        # compares the backwards since (a backward one rank made before a
        # call the ranks were refused together, then zero_grad() on every
        # rank, left the ranks' counts apart for good at stages 0-1)
        self._backwards = 0
        self._abandon_unfinished_backward()
        # a norm taken of the dropped gradients must not clip the next step
        self._prepared, self._clip_norm = None, None
        self._scaled_backward = False
        for fg in self.groups:
            fg.zero_grads()
            if fg.grad_flat is not None:
                fg.point_grads_at_flat()
        self._gradients_at_zero = self.gradient_marks()

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
            remember_external(module, param)  # as deepspeed.zero's call keeps it

    def close(self):
        """Hand the model and optimizer back to plain torch: remove the
        engine's hooks; at stage 3 gather every parameter whole again (a
        collective: every rank must call it); give the optimizer its states
        back in one process (on several ranks they stay partitioned, and
        the optimizer refuses what would start them afresh; docs/engine.md);
        give a tensor-parallel model its DTensor parameters back; free
        offload files; destroy the in-memory process group made for a
        launcher-less run (an env:// group stays for the next engine in this
        process; see _comm.join_process_group). A second call does nothing."""
        if not self._closed:
            pending = self.pending_micro_batches
            if pending and not self.inference_only:
                # the next initialize rounds the count up to a boundary
                # (_carried_counts.py): these micro-batches' update is lost
                warn_user(f"close() between an update's micro-batches: the gradients of "
                          f"{pending} micro-batch(es) of {self.config.gradient_accumulation_steps}"
                          " are not carried to a next initialize, which starts the next "
                          "update afresh. Call close() after an update's engine.step()")
            hand_back(self)
            self._closed = True


def _accumulate_grad(_engine, fg, i):
    fg.accumulate_grad(i)


def _boundary_of(engine_ref):
    """Whether the engine's coming step() updates, read at each backward's
    end (the lifecycle holds the engine weakly, as its hooks do)."""
    def boundary():
        engine = engine_ref()
        return None if engine is None else engine.is_accumulation_boundary
    return boundary
