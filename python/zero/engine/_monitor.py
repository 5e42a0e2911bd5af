"""DeepSpeed's monitors on zero's engine: the config's `tensorboard`,
`csv_monitor` and `wandb` blocks, its `flops_profiler`, and its
`comms_logger` and `memory_breakdown` (engine/_step_logs.py)
(zero.initialize(monitor=...) takes the same blocks).

[Note: monitor events] As DeepSpeed's engine writes them, on the global
rank 0 only, at each accumulation boundary, with the global samples so far
(boundaries, a skipped fp16 step's too, x train_batch_size; the boundary
count when the batch size is unknown) as the step:
- Train/Samples/train_loss: the mean of the losses given to backward()
  since the last boundary (as computed, before any fp16 scale); DeepSpeed's
  pipeline engine writes it, its plain engine does not;
- Train/Samples/lr: the first param group's learning rate after the step;
- Train/Samples/loss_scale: the fp16 loss scale, with fp16.
The loss is read with .item() at the boundary only: one synchronisation a
step on a GPU, as DeepSpeed's monitor costs.
"""
from __future__ import annotations

import csv
import os

from zero.engine._step_logs import CommsLogger, MemoryBreakdown


class Monitor:
    def __init__(self, blocks: dict):
        """blocks: check_monitor's dict; writers are opened on rank 0 only
        (the caller's choice: it builds a Monitor there)."""
        self.writers, self.loggers = [], []
        self.profiler = None
        for kind, block in blocks.items():
            if kind == "flops_profiler":
                self.profiler = FlopsProfiler(block)
            elif kind in _LOGGERS:
                self.loggers.append(_LOGGERS[kind](block))
            else:
                self.writers.append(WRITERS[kind](block))
        self.losses = []

    def before_forward(self, engine):
        if self.profiler is not None:
            self.profiler.start_if_due(engine)

    def record_loss(self, loss):
        self.losses.append(loss.detach().float().mean())

    def after_step(self, engine):
        step = engine.global_samples
        step = engine.global_steps + engine.skipped_steps if step is None else step
        events = []
        if self.losses:
            events.append(("Train/Samples/train_loss",
                           float(sum(self.losses).item()) / len(self.losses), step))
        self.losses = []
        events.append(("Train/Samples/lr", float(engine.get_lr()[0]), step))
        if engine.loss_scaler is not None:
            events.append(("Train/Samples/loss_scale", float(engine.loss_scale), step))
        for writer in self.writers:
            writer.write(events)
        for logger in self.loggers:
            logger.after_step(engine)
        if self.profiler is not None:
            self.profiler.stop_if_running(engine)

    def close(self):
        for writer in self.writers + self.loggers:
            writer.close()


class MonitorCalls:
    """engine.monitor: what scripts call on DeepSpeed's MonitorMaster (its
    tutorial's custom metrics, `engine.monitor.write_events([(tag, value,
    step)])`), into the same tensorboard/csv/wandb writers as the
    engine's own events. Written by global rank 0 (the others hold no
    writers and write nothing, as DeepSpeed's); `enabled` says whether the
    config turned a writer on, the same on every rank."""

    def __init__(self, monitor, enabled: bool):
        self._monitor, self.enabled = monitor, enabled

    def write_events(self, event_list):
        events = []
        for event in event_list:
            if not (isinstance(event, (tuple, list)) and len(event) == 3 and
                    isinstance(event[0], str)):
                raise TypeError(f"monitor.write_events takes (tag, value, step) tuples, got "
                                f"{event!r:.80}")
            tag, value, step = event
            events.append((tag, float(value), int(step)))
        if self._monitor is not None:
            for writer in self._monitor.writers:
                writer.write(events)


def _log_dir(block):
    """output_path/job_name, as DeepSpeed 0.19.8's monitors make it: without
    an output_path, ./DeepSpeedJobName (it wrote ./<kind>_logs/... before,
    where a `tensorboard --logdir DeepSpeedJobName` found nothing)."""
    return os.path.join(block.get("output_path") or "", block.get("job_name") or
                        "DeepSpeedJobName")


class _Tensorboard:
    def __init__(self, block):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ValueError("tensorboard is enabled in the config but the tensorboard "
                             f"package is not installed ({error}): pip install tensorboard, "
                             "or set tensorboard.enabled to false") from None
        self.writer = SummaryWriter(log_dir=_log_dir(block))

    def write(self, events):
        for tag, value, step in events:
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class _Csv:
    """One file per tag under output_path/job_name, named after the tag
    ("Train/Samples/lr" -> Train_Samples_lr.csv), with a header row
    (step, the tag's last part) and a row per event."""

    def __init__(self, block):
        self.directory = _log_dir(block)
        os.makedirs(self.directory, exist_ok=True)
        self.started = set()

    def write(self, events):
        for tag, value, step in events:
            path = os.path.join(self.directory, tag.replace("/", "_") + ".csv")
            with open(path, "a", newline="") as f:
                rows = csv.writer(f)
                if path not in self.started:
                    self.started.add(path)
                    if f.tell() == 0:
                        rows.writerow(["step", tag.split("/")[-1]])
                rows.writerow([step, value])

    def close(self):
        pass


class _Wandb:
    def __init__(self, block):
        try:
            import wandb
        except ImportError:
            raise ValueError("wandb is enabled in the config but the wandb package is not "
                             "installed: pip install wandb, or set wandb.enabled to false"
                             ) from None
        self.wandb = wandb
        self.run = wandb.init(project=block.get("project"), group=block.get("group"),
                              entity=block.get("team"))

    def write(self, events):
        for tag, value, step in events:
            self.wandb.log({tag: value}, step=step)

    def close(self):
        self.run.finish()


WRITERS = {"tensorboard": _Tensorboard, "csv_monitor": _Csv, "wandb": _Wandb}
_LOGGERS = {"comms_logger": CommsLogger, "memory_breakdown": MemoryBreakdown}


class FlopsProfiler:
    """DeepSpeed's flops_profiler block: the FLOPs of one training step
    (every forward and backward of the boundary's micro-batches counted by
    torch.utils.flop_counter; the optimizer's elementwise update is not a
    matrix product and is left out, as DeepSpeed leaves it), the time of
    that step from its first forward to the end of its update, and the
    achieved FLOP/s, printed with the modules' breakdown down to
    module_depth (-1: all), or written to output_file."""

    def __init__(self, block):
        self.profile_step = int(block.get("profile_step", 1))
        depth = int(block.get("module_depth", -1))
        self.depth = 999 if depth < 0 else depth
        self.detailed = bool(block.get("detailed", True))
        self.output_file = block.get("output_file")
        self.mode = None
        self.start = None
        self.done = False
        self.report = None

    def start_if_due(self, engine):
        # the update counted next is global_steps + 1
        if self.done or self.mode is not None or engine.global_steps + 1 != self.profile_step:
            return
        import time
        from torch.utils.flop_counter import FlopCounterMode
        self.mode = FlopCounterMode(depth=self.depth, display=False)
        self.mode.__enter__()
        self.start = time.perf_counter()

    def stop_if_running(self, engine):
        if self.mode is None:
            return
        import time
        seconds = time.perf_counter() - self.start
        self.mode.__exit__(None, None, None)
        total = self.mode.get_total_flops()
        lines = [f"zero flops profiler: update {engine.global_steps}",
                 f"  model parameters: {sum(p.numel() for p in engine.module.parameters()):,}"
                 " (this rank's view)",
                 f"  forward and backward FLOPs of the step: {total:,}",
                 f"  step time (first forward to update): {seconds * 1e3:.2f} ms",
                 f"  achieved: {total / seconds / 1e9:.2f} GFLOP/s"]
        modules = _model_rooted(self.mode.get_flop_counts(), engine)
        if self.detailed:  # each module's FLOPs (its submodules' included), as counted
            for name in sorted(modules, key=lambda n: (n != "Global", n)):
                flops = modules[name]
                if flops and name.count(".") <= self.depth:
                    share = flops / total if total else 0.0
                    lines.append(f"    {name:<40} {flops:>16,} {share:>7.1%}")
        self.report = {"flops": total, "seconds": seconds, "modules": modules,
                       "text": "\n".join(lines)}
        if self.output_file:
            with open(self.output_file, "w") as f:
                f.write(self.report["text"] + "\n")
        else:
            print(self.report["text"], flush=True)
        self.mode, self.done = None, True


def _model_rooted(counts, engine) -> dict:
    """{module name: FLOPs} with every name rooted at the model's class, as
    torch's counter names a plain model's modules ("Net", "Net.body.0").
    The counter starts inside the first micro-batch's forward, after the
    engine's own call began, so it names that micro-batch's modules from
    the model ("Net.body"), and the later ones' from the engine
    ("Engine.module.body"): one module in two rows, a parent smaller than
    its child. The engine's row is its model's, counted again: dropped."""
    wrapper = type(engine).__name__
    inner, root = f"{wrapper}.module", type(engine.module).__name__
    merged = {}
    for name, ops in counts.items():
        if name == wrapper:
            continue
        if name == inner or name.startswith(inner + "."):
            name = root + name[len(inner):]
        merged[name] = merged.get(name, 0) + sum(ops.values())
    return merged
