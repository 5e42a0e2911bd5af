"""Model-state memory as the engine reports it: the MemorySummary table and
the ZeRO formula beside it (Engine.memory_summary), shared with
zero.estimate_memory (_estimate.py), which predicts the same figures
before anything is allocated."""
from __future__ import annotations


class MemorySummary(dict):
    """This rank's bytes by kind; str() is a table beside the ZeRO formula."""

    def __str__(self):
        rows = [f"{'':<18}{'bytes':>16}{'MiB':>10}"]
        keys = ["params", "grads", "optimizer_states", "model_states", "buckets",
                "frozen_params"]
        if self.get("stage") == 3:
            keys[3:3] = ["persistent", "gathered_peak"]
        if self.get("host"):
            keys.append("host")
        if self.get("offloaded"):
            keys.append("offloaded")
        if self.get("params_offloaded"):
            keys.append("params_offloaded")
        for key in keys:
            if self.get(key) is None:  # an estimate cannot know it
                continue
            rows.append(f"{key:<18}{self[key]:>16,}{self[key] / 2**20:>10.2f}")
        rows.append(f"{'formula':<18}{self['formula_bytes']:>16,}"
                    f"{self['formula_bytes'] / 2**20:>10.2f}   {self['formula']}")
        return "\n".join(rows)


def zero_formula(stage, n, pb, gb, has_master, groups, totals):
    """(text, bytes) of the ZeRO paper's formula for this rank: pb and gb
    the parameter and gradient bytes per element; groups a list of (Ψ of
    the group, number of fp32 states); totals the summary's figures (for
    stage 3's gathered bytes and the offload window)."""
    psi = sum(numel for numel, _ in groups)
    if psi == 0:  # only empty parameters to train
        return f"stage {stage}: no trainable elements, N={n}", 0
    master = 4 if has_master else 0
    # K, optimizer bytes per parameter: the master plus 4 per fp32 state;
    # groups may hold different states (amsgrad, momentum), so weight them
    k = master + sum(4 * states * numel for numel, states in groups) / psi
    k = int(k) if k == int(k) else round(k, 2)
    offloaded = totals["offloaded"] > 0
    staged = totals.get("host", 0) > 0
    if offloaded or staged:  # off the model's memory: in files, or in host memory
        moved, k = k, 0
    if stage == 0:
        text, value = f"({pb}+{gb}+{k})Ψ", (pb + gb + k) * psi
    elif stage == 1:
        text, value = f"{pb + gb}Ψ + {k}Ψ/N", (pb + gb) * psi + k * psi / n
    elif stage == 2:
        text, value = f"{pb}Ψ + {gb + k}Ψ/N", pb * psi + (gb + k) * psi / n
    else:
        live = totals["persistent"] + (totals["gathered_peak"] or 0)
        # offload_param "nvme": the shard is in a file, not in memory
        held = 0 if totals.get("params_offloaded") else pb
        text = f"({held}+{gb}+{k})Ψ/N + gathered {live:,} B"
        value = (held + gb + k) * psi / n + live
        if not held:
            text += f"; parameter shard {pb}Ψ/N on nvme"
    per_rank = f"{moved}Ψ{'/N' if stage else ''}" if offloaded or staged else ""
    if staged:  # the figures are the device's; the host's are apart
        where = "on nvme; " if offloaded else ""
        text += f"; host memory {totals['host']:,} B ({per_rank} {where}states and staging)"
    elif offloaded:
        window = totals["optimizer_states"]
        text += f" + step window {window:,} B ({per_rank} on nvme)"
        value += window
    return f"stage {stage}: {text}, Ψ={psi:,}, N={n}", int(value)
