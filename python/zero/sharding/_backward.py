"""One backward's lifecycle, the same at stages 2 and 3: its start, its end
(once autograd is done with the whole graph) and, for a backward that
raised, its abandonment at the next forward.

[Note: backward lifecycle]
- begin() is called at every first sign of a backward: the gradient of
  the root module's output (every rank sees one, even where the backward
  reaches none of this rank's trainable parameters, so the collectives at
  the end stay matched), a parameter's accumulated gradient (a loss taken
  from parameters alone), and at stage 3 a module output's gradient or a
  saved parameter unpacked. The first call of a backward queues end() on
  autograd's execution engine, which runs it after the last node.
- end() finishes every group's bucket reducer (what is left is reduced, in
  order) and then what the stage adds (stage 3: release what the backward
  gathered, compare the ranks' gathers).
- A backward that raised never runs its queued callback. The next forward
  (or zero_grad) calls abandon_if_unfinished(): with no backward running,
  a begun one is dropped: the reductions in flight are waited for, the
  rest forgotten, and the stage's own state reset.
"""
from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import register_multi_grad_hook

from zero.sharding._buckets import finish_backwards
from zero.sharding._outputs import in_function_transform, tensors_in


def _no_backward_running() -> bool:
    return torch._C._current_graph_task_id() == -1


class BackwardLifecycle:
    def __init__(self, groups, serial=None, boundary=None):
        """groups: the flat groups whose bucket reducers a backward fills;
        serial: the engine's, and boundary(): whether its next step()
        updates, agreed at each backward's end (finish_backwards)."""
        self.reducers = [fg.reducer for fg in groups if fg.reducer is not None]
        self.serial = serial
        self.boundary = boundary
        self.running = False
        self.ended = 0           # backwards ended since the engine's last update (it resets it)
        self.after_begin = []    # the stage's own start (stage 3: record the pass)
        self.after_end = []      # the stage's own end, after the reducers'
        self.after_abandon = []  # the stage's own reset, after the reducers'

    def begin(self):
        if not self.running and not _no_backward_running():
            self.running = True
            for start in self.after_begin:
                start()
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self):
        finish_backwards(self.reducers, self.serial,  # one agreement for every group
                         None if self.boundary is None else self.boundary())
        for finish in self.after_end:
            finish()
        # only now: an end that raised leaves the backward to be abandoned
        self.running = False
        self.ended += 1

    @property
    def started(self) -> bool:
        return self.running or any(r.backward_started for r in self.reducers)

    def abandon_if_unfinished(self):
        if self.started and _no_backward_running():
            for reducer in self.reducers:
                reducer.abandon_backward()
            for reset in self.after_abandon:
                reset()
            self.running = False

    def watch_output(self, output):
        """begin() once the first of `output`'s tensors gets its gradient
        (the root module's output). Holds the lifecycle weakly: the hook
        lives on the user's graph."""
        if not torch.is_grad_enabled() or in_function_transform():
            # a torch.func transform's backward (per-sample gradients over
            # functional_call) reaches no parameter's accumulation, and its
            # end ran the buckets inside the transform, which failed
            return
        tensors = [t for t in tensors_in(output) if t.requires_grad and t.grad_fn is not None]
        if tensors:
            me = weakref.ref(self)

            def begin(_grad):
                lifecycle = me()
                if lifecycle is not None:
                    lifecycle.begin()
            register_multi_grad_hook(tensors, begin, mode="any")
