"""Stage 3's schedule: gather each module's parameters just before it runs,
release them after, gather again for its backward, and prefetch ahead along
the order recorded on earlier passes.

[Note: stage 3 hooks]
- forward: a module's pre-forward hook gathers the units of the parameters
  registered on it (tied parameters included), its forward hook releases
  them (unless persistent, or another running forward still needs them)
  and puts a grad hook on its outputs that gathers them again when the
  backward reaches the module.
- backward: the root module's output grad hook marks the start of a
  backward and queues the end-of-backward callback on that (outer) graph
  task; a unit is released as soon as all its parameters' gradients are
  accumulated (each gradient has then been copied into its reduction
  bucket), a frozen unit once its module's inputs have their gradients,
  and the callback releases whatever is left.
- Inside a backward, forward hooks do not release: that is activation
  checkpointing recomputing, and its backward comes right after.
- [Note: saved parameters] The module hooks cover the common case, but
  autograd may read a parameter in backward after its unit was released:
  a parameter unused on the last step (not yet expected to get a
  gradient, so its unit went when the others' gradients were in), one
  read off the path through the module's outputs (an auxiliary loss of
  the weights computed in forward). So while the root's forward runs,
  every tensor autograd saves that lies in a unit's storage is saved
  through a hook whose unpack gathers that unit again first (on demand;
  the end of the backward releases it). A gradient hook on each parameter
  does the same before torch accumulates its gradient (shaped like the
  parameter), for a late parameter no saved tensor names (x + bias).
  With every unit persistent no hook is pushed: autograd saves as it is
  and checks versions itself (0.3-0.4 ms a step in stage3_overhead).
- Collective order: every gather is issued from these hooks, in program
  order, and prefetch decisions depend only on the recorded order and the
  unit sizes, so ranks that run the same modules issue the same
  collectives. A pass in another order than recorded prefetches up to the
  first difference, gathers on demand after it, and is recorded.
"""
from __future__ import annotations

import sys

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook, saved_tensors_hooks

from zero._warnings import warn_user
from zero.sharding._attribute_reads import watch_parameter_reads
from zero.sharding._backward_hooks import gather_around_backward_hooks
from zero.sharding._copying import ModuleHook
from zero.sharding._external import add_needed_external, registered_externals
from zero.sharding._gathering import UnitGathering
from zero.sharding._outputs import (after_every_gradient, detach_from_units, in_function_transform,
                                   node_key, tensors_in)
from zero.sharding._pass_order import PassOrder
from zero.sharding._saved_parameters import SavedParameters, outer_saved_tensors_hooks
from zero.sharding._state_loads import hook_state_loads
from zero.sharding._step_agreement import agree_on_call
from zero.sharding._uncalled_roots import watch_uncalled_roots
from zero.sharding._units import GatherPool, PersistenceBudget, storage_key, units_of_params


class Stage3Schedule(UnitGathering, SavedParameters, PassOrder):
    def __init__(self, root, groups, comm, config, serial, backward, roots):
        """serial: Engine.serial; roots: the _unit_roots.UnitRoots of the units."""
        self.comm, self.serial, self.unit_roots = comm, serial, roots
        # [Note: backward lifecycle] in _backward.py: the engine's, plus this schedule's
        self.backward = backward
        backward.after_begin.append(lambda: self._start_pass("backward"))
        backward.after_end.append(self._after_backward)
        backward.after_abandon.append(self._reset_after_abandon)
        self.groups = groups
        self.max_prefetch = int(config.stage3_prefetch_bucket_size)
        self.max_live = int(config.stage3_max_live_parameters)
        self.max_reuse = int(config.stage3_max_reuse_distance)  # [Note: reuse distance]
        self.live = 0        # elements of non-persistent units gathered or in flight
        self.peak_live = 0
        # [Note: gather pool] in _units.py (the CPU's allocator keeps no freed blocks)
        self.pool = GatherPool() if comm.device.type == "cpu" else None
        self.counts = {"prefetched": 0, "on_demand": 0}  # gathers since the last step
        self.forwards = 0  # outermost forwards agreed by the ranks
        self.phase = None
        self.recorded = {"forward": None, "backward": None}
        self._in_order = {}  # id(a recorded order) -> _released_in_order's answer
        self.current, self.pos, self.diverged = [], 0, True
        self.pass_hash = 0
        self.hooks = []
        self.removed = False  # see remove()
        self.suspended = False  # every unit gathered for a generation: hooks stand aside
        # (grad_fn, output_nr) of a module's single input -> the frozen units
        # to release when its gradient comes (_release_frozen_after_backward)
        self.release_with = {}

        place = {}
        persistence = PersistenceBudget.of(config, root)
        kept = []  # every group's: gathered together (many param groups)
        for fg in groups:
            for unit in fg.units:
                for p in unit.params:
                    place[id(p)] = (fg, unit)
                # its parameters' elements (the padded total grows with the world)
                if persistence.takes(unit):
                    unit.persistent = True
                    kept.append((fg, unit))
            if fg.trainable:
                fg.reducer.on_unit_grads_done = self._grads_done
        self._gather_kept(kept)
        self.place = place
        # persistent units too: their saved tensors' versions checked (hooks: released only)
        self.unit_by_storage = {storage_key(unit.full): (fg, unit) for fg in groups
                                for unit in fg.units}
        # a released unit's placeholder, saved for backward: a read of no
        # values, named (SavedParameters._released_read)
        self.placeholder_units = {storage_key(unit.placeholder()): (fg, unit) for fg in groups
                                  for unit in fg.units if not unit.persistent}
        # every unit persistent (a small model under the threshold): no pass
        # gathers anything, so neither hooks on saved tensors nor a check
        # that the ranks gathered the same units are needed
        self.gathers_in_passes = not all(u.persistent for fg in groups for u in fg.units)
        self._saving = None  # the saved-tensor hooks, pushed while the root's forward runs
        self._outer = None   # the (pack, unpack) below ours then, if any
        self.reading_state = False  # the engine reads the state dict's names: allowed
        self.entered = []    # per hooked module: forwards whose pre-hook ran, not yet ended
        self.running = []    # the hooked modules whose forwards run, innermost last
        self.root = root
        self.modules = []
        self.units_of = {}
        for module in root.modules():
            unit_root = roots.root(module)
            if unit_root is not None and unit_root is not module:
                continue  # inside a unit root: gathered with it, no hooks of its own
            params = module.parameters() if unit_root is module else \
                module._parameters.values()
            needed = units_of_params(params, place)
            if unit_root is module and roots.is_leaf(module):
                self._mark_leaf_units(needed)
            if needed or module is root:
                self._hook_module(module, needed)
        for fg in groups:
            if not fg.trainable:
                continue
            for unit in fg.units:
                if not unit.persistent:
                    for p in unit.params:
                        self.hooks.append(p.register_hook(self._hook_before_accumulate(fg, unit)))
        for module, units in self.units_of.items():
            if units:
                self.hooks.append(module.register_state_dict_post_hook(
                    ModuleHook(self._hook_state_dict(units))))
                self.hooks += hook_state_loads(module, units)  # [Note: state dict loads]
        self.hooks += gather_around_backward_hooks(self, root, place)  # in _backward_hooks.py
        self.hooks += watch_uncalled_roots(self, root, roots)  # [Note: roots never called]
        self.hooks += watch_parameter_reads(self, root)  # [Note: parameters read by attribute]
        # the model's modules, walked once for the externals found here (a
        # walk per parameter made 800 MultiheadAttention layers take 7 s);
        # later calls walk again: a module may have left the model since
        self._model_modules = {id(m) for m in root.modules()}
        for module, param in registered_externals(root):  # deepspeed.zero's call, before us
            self.add_external(module, param)
        for module in root.modules():
            if isinstance(module, nn.MultiheadAttention) and roots.root(module) is None:
                # its forward reads out_proj's weights without calling out_proj
                for p in module.out_proj.parameters():
                    add_needed_external(self, module, p)
            for child in module.children():
                if isinstance(child, (nn.ParameterList, nn.ParameterDict)) and \
                        roots.root(child) is None:
                    # a container has no forward that runs: its owner reads
                    # the parameters (Reformer's axial position embeddings)
                    for p in child.parameters():
                        add_needed_external(self, module, p)
        self._model_modules = None

    @staticmethod
    def _mark_leaf_units(entries):
        """A leaf module's units: released when its inputs have their
        gradients (as a frozen unit), and no bucket waits for their
        parameters (FlatGroup.never_expect)."""
        by_group = {}
        for fg, unit in entries:
            unit.leaf = True
            if fg.trainable:
                by_group.setdefault(id(fg), (fg, []))[1].extend(unit.members)
        for fg, members in by_group.values():
            fg.reducer.never_expect(sorted(set(fg.reducer.never_expected) | set(members)))

    def _hook_module(self, module, needed):
        self.units_of[module] = needed
        index = len(self.modules)
        self.modules.append(module)
        self.entered.append(0)
        whole = self._whole_check(module)  # a copy's hooks: see _copying.py
        # first: the model's own pre-hooks (old weight_norm's) read the gather
        self.hooks.append(module.register_forward_pre_hook(
            ModuleHook(self._hook_pre_forward(index), whole), prepend=True))
        # with kwargs: a block(hidden_states=x)'s inputs are there (frozen units)
        self.hooks.append(module.register_forward_hook(
            ModuleHook(self._hook_post_forward(index, module is self.root), whole),
            always_call=True, with_kwargs=True))

    def _whole_check(self, module):
        units = self.units_of[module]  # the list itself: add_external extends it
        return lambda: all(u.gathered or u.persistent for _fg, u in units)

    def _in_model(self, module) -> bool:
        """module is one of the wrapped model's (the walk __init__ made,
        while it runs; else a walk now)."""
        known = self.__dict__.get("_model_modules")
        if known is not None:
            return id(module) in known
        return any(m is module for m in self.root.modules())

    def add_external(self, module, param):
        """Gather param's unit around module's forward too (a parameter the
        module uses without registering it, e.g. F.linear(x, other.weight))."""
        if id(param) not in self.place:
            raise ValueError("the parameter is not one the engine partitions (it is not "
                             "in the wrapped model)")
        if not self._in_model(module):
            raise ValueError(f"{type(module).__name__} is not a module of the wrapped model")
        entry = self.place[id(param)]
        self._in_order = {}
        if module not in self.units_of:
            self._hook_module(module, [entry])
        elif all(u is not entry[1] for _fg, u in self.units_of[module]):
            self.units_of[module].append(entry)

    def read_in_forward(self, param):
        """[Note: parameters read by attribute]: param, of a released unit,
        read by attribute while a forward runs: from now on gathered
        around the innermost running module's forward, and gathered now."""
        entry = self.place.get(id(param))
        if entry is None or self.removed or self.suspended:
            return
        fg, unit = entry
        module = self.running[-1]
        if all(u is not unit for _fg, u in self.units_of[module]):
            add_needed_external(self, module, param)
            unit.active += 1  # as the module's pre-forward counted it: its post-forward ends it
        self.ensure(fg, unit)

    # ---- agreement between ranks ------------------------------------------------

    def _agree_on_forward(self):
        """The forward's gathers are collectives: a rank that is in another
        engine call (full_state_dict or save_checkpoint made on rank 0
        alone) would pair them with that call's all-reduce and wait for
        good. One all-reduce, the one every such call starts with, finds it
        first ([Note: writes agreed] in _step_agreement.py). Counted, with
        the modes: an evaluation on some ranks only met the others' next
        training forward, agreed, and hung in the backward's gathers."""
        self.forwards += 1
        mode = f"{'grad' if torch.is_grad_enabled() else 'no grad'}, " \
            f"{'train' if self.modules[0].training else 'eval'}"
        try:
            agree_on_call(self.comm, f"forward {self.forwards} of engine {self.serial} ({mode})")
        except BaseException:
            # refused: this forward never ran, so it is not counted (counted
            # on one rank alone, every later forward was refused)
            self.forwards -= 1
            raise

    def _check_same_gathers(self):
        """Raise if another rank gathered other units in this pass (see
        [Note: matched gathers]): its values were mixed with ours."""
        if self.comm.world == 1 or self.phase is None or not self.gathers_in_passes:
            return  # the last: two all-gathers a step that could not differ
        every = self.comm.gather_scalars(self.pass_hash)
        if len(set(every)) > 1:
            raise RuntimeError(
                f"zero stage 3: the ranks gathered different parameters in this {self.phase} "
                "pass, so they ran different modules (rank-dependent control flow inside the "
                "model), or ran two engines' passes in other orders. Each module's gather is "
                "a collective: every rank must run the same modules, and the same engines' "
                "passes, in the same order (a mixture of experts: name its block in "
                "stage3_leaf_modules; LayerDrop drawn per rank, as BART's, OPT's or "
                "Whisper's encoder_layerdrop/decoder_layerdrop: set it to 0). The values of "
                "this pass are not to be trusted.")

    # ---- hooks ------------------------------------------------------------------

    def _hook_pre_forward(self, index):
        def pre_forward(module, _args):
            if self.suspended:
                return  # [Note: generation] in engine/_generation.py
            if module is self.modules[0] and self.root_depth == 0:
                refuse_function_transforms()
            if module is self.modules[0] and self.root_depth and \
                    not _inside_forward_of(module):
                self._forget_interrupted_forward()
            if module is self.modules[0] and self.root_depth == 0 and \
                    not self.in_backward and self.comm.world > 1:  # outermost, entering
                self._agree_on_forward()
            self.entered[index] += 1
            self.running.append(module)
            if module is self.modules[0] and self.root_depth == 1:  # not a recursive call
                self.abandon_if_unfinished()
                if not self.in_backward:
                    if self.max_reuse > 0:
                        self._release_kept()
                    self._start_pass("forward")
                if self._saving is None and self.gathers_in_passes:
                    # hooks pushed around the engine call (torch.utils.checkpoint of
                    # the whole model, save_on_cpu) still get every other tensor
                    self._outer = outer_saved_tensors_hooks()
                    saving = saved_tensors_hooks(self._pack, self._unpack)
                    saving.__enter__()
                    self._saving = saving  # once pushed: an interrupt before pops nothing
            self._advance(index)
            for fg, unit in self.units_of[module]:
                unit.active += 1
                self.ensure(fg, unit)
        return pre_forward

    def _hook_post_forward(self, index, is_root):
        def post_forward(module, args, kwargs, output):
            if self.suspended:
                return output
            if self.entered[index] == 0:
                return output  # an earlier pre-hook raised: ours never ran for this call
            # torch runs always_call hooks on the way out of a forward that
            # raised (output None, the exception being handled): then this
            # rank leaves the pass without the ranks' comparison, a
            # collective its peers, still gathering, would never join
            failed = output is None and sys.exc_info()[1] is not None
            self.entered[index] -= 1
            _remove_last(self.running, module)
            # a root that calls itself: the inner call is an ordinary module
            outermost = is_root and self.root_depth == 0
            if outermost:
                self._pop_saved_tensors_hooks()
            for _fg, unit in self.units_of[module]:
                unit.active -= 1
            if not self.in_backward:
                leaving = [u for fg in self.groups for u in fg.units] if outermost else \
                    [u for _fg, u in self.units_of[module]]
                if self.max_reuse > 0:  # [Note: reuse distance] in _pass_order.py
                    leaving = [u for u in leaving if not self._reused_soon(u)]
                output = detach_from_units(leaving, output)
                refusals = [self.release(unit, after_forward=True) for unit in leaving]
                refused = next((r for r in refusals if r is not None), None)
                if refused is not None:
                    raise refused
            if torch.is_grad_enabled():
                # leaves (a parameter returned as it is) have no backward to
                # wait for, and a hook on one would stay for good
                tensors = [t for t in tensors_in(output)
                           if t.requires_grad and t.grad_fn is not None]
                if len(tensors) == 1:
                    # what register_multi_grad_hook(mode="any") does for one
                    # tensor (a tensor's gradient is computed once per
                    # backward), without its wrapper, lock and handle; set
                    # once per module and forward. With the frozen-unit
                    # shortcut below: a fifth off stage 3's overhead
                    # (bench/stage3_overhead.py)
                    tensors[0].register_hook(self._hook_pre_backward(
                        index, is_root, node_key(tensors[0])))
                elif tensors:
                    register_multi_grad_hook(tensors, self._hook_pre_backward(index, is_root),
                                             mode="any")
                if not self.in_backward and not is_root:
                    self._release_frozen_after_backward(module, (args, kwargs))
            if outermost and not self.in_backward:
                if not failed:
                    self._check_same_gathers()
                self._end_pass()
            return output
        return post_forward

    def _release_frozen_after_backward(self, module, args):
        """A frozen unit gets no gradient to say its module's backward is
        over; the gradients of the module's inputs do (every path from
        the module's output to its inputs runs through its weights), so
        the unit goes then rather than at the end of the backward: a
        frozen base model under adapters (LoRA) then holds one module's
        weights at a time in backward, not the whole model."""
        frozen = [u for fg, u in self.units_of[module]
                  if (not fg.trainable or u.leaf) and not u.persistent]
        if not frozen:
            return  # the usual case, decided before walking the inputs
        # a leaf's hook would stay on it for good (see post_forward)
        inputs = [t for t in tensors_in(args) if t.requires_grad and t.grad_fn is not None]
        if not inputs:
            return  # nothing to wait for: released at the end of the backward

        def release_frozen():
            if self.removed:
                return
            for unit in frozen:
                self.release(unit)
        after_every_gradient(inputs, release_frozen)  # (no node cycle: see there)
        if len(inputs) == 1:
            # the module before (whose output this input is) gathers for its
            # backward from a hook on the same tensor that was set first, so
            # it would run before this release: it runs the release itself
            # (_hook_pre_backward), and the two units are never held at once
            self.release_with.setdefault(node_key(inputs[0]), []).extend(frozen)

    def _hook_state_dict(self, units):
        def warn_if_released(_module, _state, _prefix, _metadata):
            """state_dict() of a module whose parameters are released holds
            their empty placeholders: a checkpoint saved from it is empty.
            A warning, not an error: PEFT takes the whole model's
            state_dict() and keeps only the adapters. (The engine's own
            readers say so with `reading_state`.)"""
            if self.reading_state or all(u.gathered or u.persistent for _fg, u in units):
                return
            warn_user("zero stage 3: state_dict() holds empty placeholders for the parameters "
                      "released after use, so a checkpoint saved from it lacks them. Use "
                      "engine.full_state_dict() (a collective: every rank calls it, and it returns "
                      "copies) or engine.save_checkpoint(); within zero.GatheredParameters(...) "
                      "the listed parameters are whole (copy what you keep).", RuntimeWarning)
        return warn_if_released

    def _hook_before_accumulate(self, fg, unit):
        lifecycle = self.backward

        def before_accumulate(_grad):
            if unit.gathered and lifecycle.running:
                return  # the usual case, once per parameter a backward: kept lean
            self.begin_backward()
            # torch's accumulation lays the gradient out like the parameter,
            # which must then be the gathered one, not the placeholder
            # ([Note: saved parameters]: a late gradient, e.g. of x + bias)
            if not unit.gathered:
                self.ensure(fg, unit)
        return before_accumulate

    def _hook_pre_backward(self, index, is_root, key=None):
        def pre_backward(_grad):
            self._refuse_if_removed()
            if torch.is_grad_enabled():
                raise RuntimeError(
                    "zero stage 3 does not support a backward with create_graph=True (double "
                    "backward, as in gradient penalties): the graph it builds would keep "
                    "parameters that stage 3 releases. Use stage 2, or compute the penalty "
                    "without differentiating the gradients.")
            self.begin_backward()
            for unit in self.release_with.pop(key, ()):
                self.release(unit)  # the next module's frozen units: its backward is over
            self._advance(index)
            module = self.modules[index]
            for fg, unit in self.units_of[module]:
                self.ensure(fg, unit)
        return pre_backward

    def begin_backward(self):
        """The first sign of a backward: a module output's gradient, or,
        in a backward that reaches no module output (a loss term taken
        from parameters in zero.GatheredParameters), a saved parameter
        unpacked or a gradient accumulated. Its end then reduces what is
        left and releases what it gathered, as stage 2's does."""
        self.backward.begin()

    @property
    def in_backward(self) -> bool:
        return self.backward.running

    def _after_backward(self):
        """The end of a backward, once the buckets are reduced."""
        self.release_with = {}
        self.release_all()
        try:
            self._check_same_gathers()
        finally:
            self._end_pass()

    @property
    def root_depth(self) -> int:
        """Root forwards running (a root may call itself)."""
        return self.entered[0]

    def _pop_saved_tensors_hooks(self):
        if self._saving is not None:
            saving, self._saving = self._saving, None
            saving.__exit__(None, None, None)

    def _forget_interrupted_forward(self):
        """A root forward that ended by KeyboardInterrupt (a notebook's stop
        button) skipped the post-forward hooks, which torch calls only for
        an Exception: drop what it left, so the next forward is a pass of
        its own and not taken for a recursive call."""
        if self._saving is not None and \
                outer_saved_tensors_hooks() != (self._pack, self._unpack):
            # pushed by a forward that backward recomputed (a whole-model
            # activation checkpoint): torch dropped them with the autograd
            # engine's own stack when that backward ended. Popped again here,
            # the next forward met torch's INTERNAL ASSERT (SavedTensorHooks)
            self._saving = None
        self._pop_saved_tensors_hooks()
        self.entered = [0] * len(self.entered)
        self.running = []
        self.phase = None
        for fg in self.groups:
            for unit in fg.units:
                unit.active = 0

    def abandon_if_unfinished(self):
        self.backward.abandon_if_unfinished()

    def _reset_after_abandon(self):
        """A backward that raised never reached its end callback: once its
        buckets are dropped (what was already reduced stays, as a failed
        torch backward leaves partial .grad: call engine.zero_grad()),
        release its gathered units, so the next pass starts clean."""
        self.phase = None
        self.release_with = {}
        for fg in self.groups:
            for unit in fg.units:
                unit.active = 0
        self.release_all()

    def take_counts(self) -> dict:
        counts, self.counts = self.counts, {"prefetched": 0, "on_demand": 0}
        return counts

    def remove(self):
        """Engine.close(). The hooks set on autograd graphs (a backward's,
        the saved tensors') cannot be removed: they refuse from now on."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.removed = True
        # a root forward interrupted (KeyboardInterrupt skips the forward
        # hooks) left our saved-tensor hooks on: the next root forward
        # would drop them, but a closed engine has none
        if self._saving is not None and outer_saved_tensors_hooks() == (self._pack,
                                                                          self._unpack):
            self._pop_saved_tensors_hooks()

    def _refuse_if_removed(self):
        if self.removed:
            raise RuntimeError(
                "this autograd graph was built by a zero stage-3 engine that has been closed, "
                "or dropped without close() (its parameters were released while it was "
                "built): run the forward again on the model as it is now")


def refuse_function_transforms():
    """A stage-3 forward inside torch.func's transforms (grad, vmap, jacrev:
    per-sample gradients, functional_call with the gradients of the
    weights passed in) is refused by name: the gathers, releases and
    saved-tensor hooks do not run under them (torch refused the hooks, or
    a backward with create_graph, which functorch always asks for, naming
    neither stage 3 nor a way out)."""
    if in_function_transform():
        raise RuntimeError(
            "zero stage 3: the model runs inside a torch.func transform (grad, vmap, jacrev, "
            "...), which stage 3's gathers and releases do not support. Use stage 0-2 "
            "(torch.func works on their models), or compute it on a plain copy of the "
            "weights (engine.full_state_dict() into a model of your own)")


def _remove_last(running, module):
    """module's last entry off the running stack (the top, unless forwards
    ended out of order)."""
    for k in range(len(running) - 1, -1, -1):
        if running[k] is module:
            del running[k]
            return


def _inside_forward_of(module) -> bool:
    """Whether a frame of `module`'s forward is on this thread's stack (a
    root that calls itself), checked only when a root forward seems to be
    running already."""
    code = getattr(type(module).forward, "__code__", None)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False
