"""ZeRO-Offload's one-step delayed parameter update
(offload_optimizer.delayed_update, off by default).

[Note: delayed update]
- With the master and states on the host apart from a GPU model (the
  staged step), the host update of step k runs on a thread of its own
  while the GPU runs the forward and backward of step k+1, whose gradients
  are therefore taken at the parameters from before update k. For a model
  on the CPU with its states in files, the thread's disk reads and writes
  overlap the CPU's forward and backward the same way (the update's
  arithmetic shares the cores). Written as a loop, with w the
  master and v the parameters the model computes with:
      g = grad(v); v = w; w = update(w, g)
  so w_{k+1} = update(w_k, grad(w_{k-1})): every update lands one step
  late (tests/test_delayed_update.py checks exactly this reference).
- At the boundary the gradient partition is copied into a host buffer of
  its own (the next backward refills the partition meanwhile), the step
  counts and the hyperparameters are taken as they are then (a scheduler
  that changes the lr afterwards changes the next update), and the thread
  updates the host master and states and writes the new parameters into a
  second host buffer, not into the parameters the GPU is reading.
- The update lands at the next call that reads or writes the partitions:
  the next boundary's step() or clip_grad_norm_(), save_checkpoint,
  full_state_dict, GatheredParameters, close() (all of them collectives,
  so every rank applies it at the same point): take_in_parameter_writes
  (sharding/_param_writes.py) waits for the thread, copies the new
  parameters in and all-gathers them. load_checkpoint waits and drops it.
- A parameter written in place between boundaries cannot be taken in then
  (the master has moved on by a step the written value never saw): the
  ranks refuse it together and drop the write; write inside
  zero.GatheredParameters, which lands the pending update first.
- A failure inside the thread (an I/O error of the states' files) is
  raised at the point the update would have landed; the step is then
  partly applied, as a failed offloaded step always is.
- Memory: the two buffers, one partition of gradients and one of
  parameters, in place of the staged step's chunk windows; and a master
  of its own in fp32 (in the states' files with "nvme"), since the
  parameters cannot be the master the thread writes.
"""
from __future__ import annotations

import threading

from zero._interrupts import interrupts_held
from zero.sharding._groups_together import refresh_params
from zero.sharding._param_writes import bump_versions


def delayed_update_for(offload, staged, step_path, device):
    """The engine's DelayedUpdate, or None when offload.delayed_update is
    off; refused where the states are not apart from the model."""
    if not offload.delayed_update:
        return None
    if not staged and offload.device != "nvme":
        raise ValueError(
            "offload_optimizer.delayed_update overlaps the update with the next forward and "
            f"backward: the host's with a GPU's, or the disk's reads and writes with the "
            f"CPU's; the model is on {device.type} and its states in host memory, so there is "
            "nothing to overlap: leave delayed_update out")
    return DelayedUpdate(step_path)


class DelayedUpdate:
    def __init__(self, step_path):
        self.step_path = step_path
        self._thread = None
        self._done = None      # set by the thread as it ends
        self._error = None
        self._groups = []      # the groups whose update is in flight or done, not landed

    @property
    def pending(self) -> bool:
        return bool(self._groups)

    def launch(self, spec, optimizer, groups, grad_scale):
        """Start the host update of every group over a copy of its
        gradients (the main thread's copies; the thread does host work
        only). The step counts advance now, as the direct step's do."""
        work = []
        for fg in groups:
            group = optimizer.param_groups[fg.index]
            fg.step_count += spec.counts_as_step(group)
            fg.hand_grads_to_delayed()
            # a copy: the caller's scheduler steps the live group next
            work.append((fg, dict(group), fg.step_count))

        done = threading.Event()

        def run():
            try:
                for fg, group, count in work:
                    self.step_path.update_delayed(spec, optimizer, group, fg, grad_scale, count)
            except BaseException as error:  # raised where the update would land
                self._error = error
            finally:
                done.set()
        self._done = done
        self._groups = list(groups)
        # not a daemon: a process that ends with an update in flight
        # waits for it (a daemon thread inside the C core or torch at
        # interpreter exit aborts the process)
        self._thread = threading.Thread(target=run, name="zero-delayed-update", daemon=False)
        self._thread.start()

    def wait(self):
        """Until the thread is done; its failure, or None. Interruptible:
        a KeyboardInterrupt leaves the thread running and this to wait for
        again. On an event, not Thread.join(): CPython 3.11's join, when
        interrupted, marks a thread still running as stopped, so the next
        wait returned at once and a second update ran beside the first on
        the same offload windows (a segfault, or silently other weights)."""
        if self._thread is not None:
            self._done.wait()
            self._thread.join()  # done: returns at once
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            self._groups = []  # partly applied: nothing consistent to land
        return error

    def land(self):
        """The new parameters into each group's shard, then gathered: a
        collective at stages 1-3 (the caller is one on every rank). Whole
        or not at all: Ctrl-C between two groups' copies left the later
        groups a whole update behind their masters, with nothing pending
        to land them (a rerun batch then trained from mixed weights)."""
        with interrupts_held():
            groups, self._groups = self._groups, []
            for fg in groups:
                fg.take_delayed_params()
            refresh_params(groups)  # the small groups together
            for fg in groups:
                bump_versions(fg)

    def finish(self):
        """close(): land the last update (a collective, as the step's
        gather is)."""
        if self.pending:
            failure = self.wait()
            if failure is not None:
                raise failure
            self.land()

    def drop(self):
        """load_checkpoint: what the thread computed is replaced anyway."""
        self.wait()
        self._groups = []

    @staticmethod
    def refuse_writes(written) -> RuntimeError:
        """The error for parameters written in place while an update is
        pending; the writes are dropped as they are reported (their
        versions seen), so training goes on from the engine's values."""
        names = sorted({fg.names[unit.members.start + j] for fg, unit, j in written})
        for fg, unit, j in written:
            fg.seen_versions[unit.members.start + j] = unit.params[j]._version
        return RuntimeError(
            f"offload_optimizer.delayed_update: parameter(s) {', '.join(names[:5])}"
            f"{f' (and {len(names) - 5} more)' if len(names) > 5 else ''} were "
            "changed in place since the last step, while that step's update was still being "
            "computed from the values before; the change cannot be taken in (the update "
            "lands over it), so it was dropped: training goes on from the engine's values. "
            "Make such writes inside zero.GatheredParameters(params, modifier_rank=0), which "
            "lands the pending update first, or turn delayed_update off")
