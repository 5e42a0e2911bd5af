"""DeepSpeed's `comms_logger` block and `memory_breakdown` switch, printed
by global rank 0 at each accumulation boundary (after the step), from
engine.comm_summary() and engine.memory_summary(). Part of the monitor
(engine/_monitor.py builds them from the config's blocks).

- comms_logger: each step's collectives of the engine (not the user's own
  torch.distributed calls), counted and summed by operation. `verbose`
  prints every step's; `prof_ops` keeps only the named operations, and
  `prof_all: false` without prof_ops records none, as in DeepSpeed;
  `debug` is accepted without effect. The totals are printed by
  engine.comms_log_summary(), zero.deepspeed.comm.log_summary() (the
  engine that logged last) and at close().
- memory_breakdown: one line a step with the model states by kind (the
  memory_summary() figures), the host-side bytes, the device allocator's
  current and peak bytes (CUDA) and the process's resident memory.
DeepSpeed prints at each forward, backward and step; zero once a step.
"""
from __future__ import annotations

import os

import torch

MIB = 2 ** 20
_latest = None  # the CommsLogger that logged last, for zero.deepspeed.comm.log_summary


def latest_comms_logger():
    return _latest


class CommsLogger:
    def __init__(self, block: dict, write=print):
        self.verbose = bool(block.get("verbose", False))
        ops = block.get("prof_ops") or []
        self.ops = set(ops) if ops else None if block.get("prof_all", True) else set()
        self.write = write
        self.totals, self.steps = {}, 0
        self.printed_at = 0  # the steps counted when the table was last printed

    def after_step(self, engine):
        global _latest
        _latest = self
        ops = {op: f for op, f in engine.comm_summary().get("ops", {}).items()
               if self.ops is None or op in self.ops}
        self.steps += 1
        for op, f in ops.items():
            total = self.totals.setdefault(op, {"calls": 0, "bytes": 0})
            total["calls"] += f["calls"]
            total["bytes"] += f["bytes"]
        if self.verbose and ops:
            self.write(f"comms: step {engine.global_steps}: " + "; ".join(
                f"{op} {f['calls']} calls {f['bytes'] / MIB:.3f} MiB" for op, f in ops.items()))

    def log_summary(self):
        self.printed_at = self.steps
        rows = [f"{'operation':<24}{'calls':>10}{'total MiB':>14}{'MiB a step':>14}"]
        for op, total in sorted(self.totals.items()):
            rows.append(f"{op:<24}{total['calls']:>10}{total['bytes'] / MIB:>14.3f}"
                        f"{total['bytes'] / MIB / max(self.steps, 1):>14.3f}")
        self.write(f"comms over {self.steps} step(s):\n" + "\n".join(rows))

    def close(self):
        # the table once more only for steps it has not shown (a script that
        # printed it with log_summary() before destroy() got it twice;
        # DeepSpeed's destroy() prints nothing)
        if self.steps > self.printed_at:
            self.log_summary()


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class MemoryBreakdown:
    def __init__(self, block: dict, write=print):
        self.write = write

    def after_step(self, engine):
        m = engine.memory_summary()
        parts = [f"memory: step {engine.global_steps}: model states "
                 f"{m['model_states'] / MIB:.2f} MiB (params {m['params'] / MIB:.2f}, grads "
                 f"{m['grads'] / MIB:.2f}, optimizer states {m['optimizer_states'] / MIB:.2f}, "
                 f"gathered {m['gathered_peak'] / MIB:.2f}), host {m['host'] / MIB:.2f} MiB"]
        if engine.device.type == "cuda":
            parts.append(f"device allocated {torch.cuda.memory_allocated(engine.device) / MIB:.2f}"
                         f" MiB (peak {torch.cuda.max_memory_allocated(engine.device) / MIB:.2f})")
        rss = _resident_bytes()
        if rss is not None:
            parts.append(f"process resident {rss / MIB:.1f} MiB")
        self.write("; ".join(parts))

    def close(self):
        pass
