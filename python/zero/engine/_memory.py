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


def zero_formula(stage, n, pb, gb, has_master, groups, totals, staged=False,
                 shard_on_host=False, grads_on_host=False):
    """(text, bytes) of the ZeRO paper's formula for this rank: pb and gb
    the parameter and gradient bytes per element; groups a list of (Ψ of
    the group, number of fp32 states); totals the summary's figures (for
    stage 3's gathered bytes and the offload window). staged: the master
    and states in host memory apart from a GPU model. shard_on_host and
    grads_on_host: stage 3's parameter shard and gradient partition kept
    in host memory apart from a GPU model ([Note: parameters off the
    device] in _param_staging.py)."""
    psi = sum(numel for numel, _ in groups)
    if psi == 0:  # only empty parameters to train
        return f"stage {stage}: no trainable elements, N={n}", 0
    master = 4 if has_master else 0
    # K, optimizer bytes per parameter: the master plus 4 per fp32 state;
    # groups may hold different states (amsgrad, momentum), so weight them
    k = master + sum(4 * states * numel for numel, states in groups) / psi
    k = int(k) if k == int(k) else round(k, 2)
    offloaded = totals["offloaded"] > 0
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
        on_disk = bool(totals.get("params_offloaded"))
        held = 0 if on_disk or shard_on_host else pb
        g = 0 if grads_on_host else gb
        text = f"({held}+{g}+{k})Ψ/N + gathered {live:,} B"
        value = (held + g + k) * psi / n + live
        if on_disk:
            text += f"; parameter shard {pb}Ψ/N on nvme"
    per_rank = f"{moved}Ψ{'/N' if stage else ''}" if offloaded or staged else ""
    on_host = []  # the figures are the device's; the host's are apart
    if shard_on_host and not totals.get("params_offloaded"):
        on_host.append(f"parameter shard {pb}Ψ/N")
    if grads_on_host:
        on_host.append(f"gradient partition {gb}Ψ/N")
    if staged:
        where = "on nvme; " if offloaded else ""
        on_host.append(f"{per_rank} {where}states and staging")
    if on_host:
        text += f"; host memory {totals['host']:,} B ({', '.join(on_host)})"
    elif offloaded:
        window = totals["optimizer_states"]
        text += f" + step window {window:,} B ({per_rank} on nvme)"
        value += window
    return f"stage {stage}: {text}, Ψ={psi:,}, N={n}", int(value)
