"""The engine's step at the accumulation boundary (a mixin of Engine):
clip_grad_norm_, step, and the reduction and update behind them.

[Note: boundary step] engine.step() is called after every micro-batch; it
acts only at the accumulation boundary: (1) reduce the gradients (stages
0-1; stage 2 reduced them during backward), (2) one sum of squares over this
rank's gradient partition, summed over ranks, gives the global norm and the
fp16 overflow check at once, (3) skip on overflow (fp16) or update, (4)
all-gather the updated parameters (stages 1-2), (5) zero the gradients and
step the LR scheduler (not on a skipped step).
"""
from __future__ import annotations

import math
import numbers

import torch

from zero._interrupts import interrupts_held
from zero._warnings import warn_user
from zero.engine._optimizer_step_hooks import has_post_hooks, run_post_hooks, run_pre_hooks
from zero.engine._unchanged import check_optimizer_unchanged
from zero.sharding._buckets import finish_backwards
from zero.sharding._groups_together import reduce_boundary, refresh_params, sum_across_replicas
from zero.sharding._param_writes import (bump_versions, released_writes_refusal,
                                         take_in_parameter_writes)
from zero.sharding._step_agreement import describe_settings
from zero.step import _step_path
from zero.step._clipping import clip_coefficient, model_parallel_sumsq


_NORM_LIMIT = 2.0 ** 64  # the gradient norm whose square overflows fp32


class BoundaryStep:
    """Mixed into Engine: step() and clip_grad_norm_(), with the reduction,
    norm, clipping and update they share ([Note: boundary step])."""

    def _prepare_boundary(self):
        """Reduce the gradients and take the global squared norm (once)."""
        if self._prepared is not None:
            return self._prepared
        if not self.policy.reduces_in_backward:
            for fg in self.groups:
                fg.gather_stray_grads()
            reduce_boundary(self.groups)  # the small groups together
        else:
            # No backward reached this rank's hooks since the last step:
            # still issue the collectives the other ranks issue (this
            # covers one backward per step; see docs/engine.md).
            finish_backwards([fg.reducer for fg in self.groups if not fg.reduced_since_step],
                             self.serial, boundary=True)  # a step that updates: here
        for fg in self.groups:
            fg.reduced_since_step = False
        sum_across_replicas(self.groups)  # the small groups together
        if self._pipeline is not None:  # a tied head's copies take the same gradient
            self._pipeline.sum_ties(self.groups, self._comm, self.policy.partitions)
        sumsq = self.step_path.squared_norm(self.groups, self._comm,
                                            across_ranks=self.policy.partitions)
        sumsq = model_parallel_sumsq(sumsq, self.groups, self._comm, self.policy.partitions,
                                     self._tensor_parallel or self._mpu, self._pipeline)
        base = 1.0 / (self.loss_scale * self._comm.dp_world *
                      self.config.gradient_accumulation_steps)
        # a NaN gradient gives a NaN norm, as torch's clip_grad_norm_ does
        norm = math.sqrt(sumsq) * base if math.isfinite(sumsq) else abs(sumsq)
        self._prepared = (sumsq, norm, base)
        return self._prepared

    def gradient_marks(self):
        """What changes when a gradient arrives: at stages 2-3 the count of
        ended backwards (plain loss.backward() too); at stages 0-1 the
        version counters of the flat gradient buffers, which every .grad
        views and autograd adds into in place."""
        if self._backward is not None:
            return self._backward.ended
        return tuple(fg.grad_flat._version for fg in self.groups if fg.grad_flat is not None)

    def _no_gradients_since_update(self, backwards: int) -> bool:
        """No gradient reached this rank since the last update, or since a
        zero_grad() that dropped them (the marks taken then, and at
        initialize). engine.backward()s at stages 0-1 are counted in
        `backwards`."""
        if backwards and self._backward is None:
            return False
        return self._gradients_at_zero == self.gradient_marks()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the coming update to max_norm (global L2 norm over all shards)
        and return the norm before clipping. Call after the backward of the
        boundary micro-batch, before step(). A collective: every rank must
        call it."""
        self._check_open()
        self._check_trains("clip_grad_norm_")
        refusal = None
        if torch.is_tensor(max_norm) and max_norm.numel() == 1:
            max_norm = max_norm.item()  # as torch's clip_grad_norm_ takes it
        if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
            refusal = TypeError(f"max_norm must be a number > 0, got {max_norm!r}")
        elif not max_norm > 0:
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

    def step(self, lr_kwargs=None):
        """At the accumulation boundary: reduce the gradients over the
        ranks, clip (gradient_clipping, or clip_grad_norm_'s max_norm),
        update this rank's partition (fp16: skipped on overflow), gather the
        new parameters, step the lr scheduler (with DeepSpeed's lr_kwargs,
        a dict of its step()'s keyword arguments) and zero the gradients.
        Before it, only counts the micro-step. A collective: every rank
        calls it as often; what would refuse the step on one rank refuses
        it on every rank, before anything changes."""
        if callable(lr_kwargs):  # torch's optimizer.step(closure) habit
            raise TypeError("engine.step() takes no closure: compute the loss, call "
                            "engine.backward(loss), then engine.step() (optimizers that "
                            "re-evaluate the loss, as LBFGS, are not supported)")
        if lr_kwargs is not None and not isinstance(lr_kwargs, dict):
            raise TypeError(f"lr_kwargs must be a dict of keyword arguments for the lr "
                            f"scheduler's step(), got {type(lr_kwargs).__name__}")
        self._lr_kwargs = lr_kwargs or {}
        self._check_open()
        self._check_trains("step")
        self._step_applied = False  # until a boundary's update is applied
        unscaled = None
        if self.loss_scaler is not None and not self._scaled_backward:
            # the gradients would be divided by a scale the loss never had
            unscaled = RuntimeError(
                "fp16: step() needs an engine.backward(loss) since the last step() or "
                "zero_grad(), and none came (zero_grad() drops the gradients a backward "
                "left; a plain loss.backward() does not multiply the loss by the loss scale, "
                "which step() divides the gradients by)")
        boundary = self.is_accumulation_boundary and not self._in_no_sync
        if unscaled is not None and not boundary:
            raise unscaled  # no collective here; the counts differ at the next one
        if self._in_no_sync:
            self._scaled_backward = False
            return
        if boundary and self._delayed is not None and self._delayed.pending:
            # the last update lands in the agreement below: from there through
            # this step's launch, Ctrl-C waits, so the step is whole or not
            # taken (an interrupt after the landing alone aborted a step whose
            # rerun batch then trained from other weights than an
            # uninterrupted run's)
            with interrupts_held():
                self._counted_step(boundary, unscaled)
        else:
            self._counted_step(boundary, unscaled)

    def _counted_step(self, boundary, unscaled):
        """step() from its agreement on: the micro-step counted, and at the
        boundary the reduction and update."""
        if boundary:
            # everything that can refuse, before anything changes, and
            # agreed over the ranks: a refusal on one rank alone, or settings
            # changed on one rank alone, stop every rank ([Note: writes agreed])
            refusal, settings = unscaled, ""
            try:
                if refusal is None:
                    # [Note: optimizer step hooks]: before the checks, which
                    # then see what a hook set (a learning rate)
                    run_pre_hooks(self.optimizer)
                    check_optimizer_unchanged(self)
                    check_scheduler_call(self.lr_scheduler, self._lr_kwargs)
                    _step_path.check_every_group(self._spec, self.optimizer, self.groups)
                if self._comm.dp_world > 1:  # compared over every data-parallel rank
                    settings = describe_settings(self.optimizer.param_groups,
                                                 [fg.index for fg in self.groups])
            except Exception as error:  # noqa: BLE001 - a hook's too: raised on every rank
                refusal = error
            # the zero_grad() calls since the last update too: one made on
            # some ranks only drops gradients there alone (at stages 2-3
            # from that rank's partition: half the model then steps on the
            # average, the rest on nothing); and the backwards: a step()
            # skipped on each rank at another batch paired steps that summed
            # other numbers of batches (stages 0-1 reduce only here)
            # (at stages 2-3 every backward, plain loss.backward() too)
            backwards = self._backwards if self._backward is None else self._backward.ended
            if refusal is None and self._no_gradients_since_update(backwards):
                warn_user("engine.step() updates with no backward since the last update (or "
                          "a zero_grad() dropped its gradients): the gradients are zero, so "
                          "only weight decay and the lr schedule move. Call "
                          "engine.backward(loss) before step()")
            call = self.call_text(f"step() after {self._zero_grad_calls} zero_grad() calls "
                                  f"and {backwards} backwards")
            take_in_parameter_writes(self.all_groups, call, refusal, settings)
        self._scaled_backward = False
        self.micro_steps += 1
        if not boundary:
            return
        sumsq, norm, base = self._prepare_boundary()
        with interrupts_held():  # the update and its bookkeeping: whole, or not at all
            self._apply_boundary(sumsq, norm, base)

    def _update_groups(self, scale):
        """Each group's update, then every group's parameters gathered (the
        small groups together: refresh_params) and their versions bumped.
        A group whose update raised stops the step with no collective
        issued: its rank may be the only one that failed, and a gather of
        other sizes than its peers' would meet theirs (gloo aborts the
        process then). The step is partly applied, as an offloaded step
        that fails is (docs/offload.md): the groups updated before hold
        their new chunks beside their peers' old ones (before the groups
        went together, each was gathered as it was updated, which kept
        the ranks alike when all of them failed at the same group), so a
        run goes on from a checkpoint, whose load gathers every group."""
        for done, fg in enumerate(self.groups):
            counted = self._spec.counts_as_step(self.optimizer.param_groups[fg.index])
            fg.step_count += counted
            try:
                self.step_path.update(self._spec, self.optimizer,
                                      self.optimizer.param_groups[fg.index], fg, scale)
            except BaseException:
                # a refusal comes before anything changes; a failure in
                # the middle of a chunked update (files, offload_param)
                # leaves it partly applied (docs/offload.md)
                fg.step_count -= counted
                for changed in self.groups[:done + 1]:
                    bump_versions(changed)  # a graph that saved them is stale
                raise
            fg.write_back_shard()
        refresh_params(self.groups)
        for fg in self.groups:
            # autograd then refuses a backward through a graph that saved
            # the old values, as after torch.optim's step
            bump_versions(fg)

    def _apply_boundary(self, sumsq, norm, base):
        """step()'s part from the reduced gradients on: skip or update, gather
        the parameters, count the step, move the schedule, zero the
        gradients."""
        max_norm = self._clip_norm or self.config.gradient_clipping
        self._prepared, self._clip_norm = None, None
        failure = None
        # a norm whose square overflows fp32 (2**64, about 1.8e19) too: the
        # core sums in double, so such gradients stayed finite, and Adam's
        # fp32 second moments became inf for good (the weights never moved
        # again), where DeepSpeed's fp32 norm finds the overflow
        overflow = not math.isfinite(sumsq) or norm > _NORM_LIMIT
        self.step_was_skipped = overflow and (self.loss_scaler is not None or
                                              self.config.check_grad_overflow)
        if self.step_was_skipped:
            self.skipped_steps += 1
            if self.loss_scaler:
                try:
                    self.loss_scaler.update(True)
                except FloatingPointError as error:  # at its floor: raised below,
                    failure = error  # the skipped step's gradients dropped first
        else:
            if self.loss_scaler:
                self.loss_scaler.update(False)
            coef = clip_coefficient(max_norm, norm)
            for fg in self.all_groups:
                fg.settle_copies()  # the update writes what gathers read
            if self._delayed is not None:  # lands at the next boundary
                self._delayed.launch(self._spec, self.optimizer, self.groups, base * coef)
            if self._delayed is None:
                self._update_groups(base * coef)
            self.global_steps += 1
            # The engine stepped on the optimizer's behalf; torch's schedulers
            # read this flag to warn about stepping before the optimizer.
            self.optimizer._opt_called = True
            # what the post-hooks may ask the engine about this step
            self._step_applied, self._global_grad_norm = True, norm
            failure = run_post_hooks(self.optimizer)  # [Note: optimizer step hooks]
            if failure is None and self._schedule is not None and \
                    has_post_hooks(self.optimizer):
                failure = released_writes_refusal(
                    self.all_groups, "an optimizer step post-hook (run after the update at "
                    "stage 3, where the parameters are released: write them inside "
                    "zero.GatheredParameters(params, modifier_rank=0) in the hook)")
            if self.lr_scheduler is not None:
                try:
                    self.lr_scheduler.step(**self._lr_kwargs)
                except Exception as error:  # noqa: BLE001 - raised below
                    failure = failure or error
        # The update is applied: what user code raised above (a post-hook,
        # the scheduler: OneCycleLR past its total_steps) is raised once
        # the rest is done. Raised at once, it left the gradients in place,
        # and the next step added them to its own
        self._step_applied = not self.step_was_skipped
        # an overflow's norm reads inf, as DeepSpeed's (a sum with an inf
        # and a -inf gradient made it nan, which an isinf count missed)
        self._global_grad_norm = float("inf") if self.step_was_skipped and norm != norm \
            else norm
        self.zero_grad()
        self._zero_grad_calls = self._backwards = 0
        if self._backward is not None:
            self._backward.ended = 0
            self._gradients_at_zero = 0
        self._last_comm = self._comm.log.summary()
        if self._schedule is not None:
            self._last_comm["stage3_gathers"] = self._schedule.take_counts()
        self._comm.log.reset()
        replicate = self._comm.replicate
        if replicate is not None:  # hybrid sharding: what crossed the replicas
            self._last_comm["dp_replicate"] = replicate.log.summary()
            replicate.log.reset()
        if self._monitor is not None:
            self._monitor.after_step(self)
        if failure is not None:
            raise failure


def check_scheduler_call(lr_scheduler, lr_kwargs):
    """ReduceLROnPlateau steps on the metric it watches, which DeepSpeed's
    engine.step(lr_kwargs={"metrics": value}) hands over. Without it,
    torch's step() raised after the update: refused before it instead."""
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and \
            "metrics" not in lr_kwargs:
        raise TypeError(
            "engine.step(): the lr_scheduler is ReduceLROnPlateau, which steps on the metric "
            "it watches: pass it, engine.step(lr_kwargs={'metrics': value}) (the same value "
            "on every rank, a validation loss all-reduced), or keep the scheduler out of "
            "initialize and call its step(value) yourself. Nothing was updated")
