"""deepspeed.zero: Init (building a model partitioned over the ranks) and
GatheredParameters, on zero's partitioned_init and GatheredParameters."""
from __future__ import annotations

import contextlib
import json
import os

from zero.config._config import Config
from zero.sharding._external import (register_external_parameter,  # noqa: F401
                                     unregister_external_parameter)
from zero.sharding._gathered import GatheredParameters as _Gathered
from zero.sharding._partitioned_init import partitioned_init


class Init:
    """with deepspeed.zero.Init(...): model = Model(...) builds each
    parameter partitioned over the ranks as it is made (zero's
    partitioned_init); zero.initialize (or deepspeed.initialize) at stage 3
    takes the pieces. enabled=False builds the model whole. With
    remote_device="nvme" (or a config whose offload_param is "nvme"), the
    pieces live in files under its nvme_path, for a model larger than
    memory. DeepSpeed's other arguments (mem_efficient_linear, pin_memory,
    dtype, ...) are accepted. Refused: module (a model built already:
    zero.initialize at stage 3 partitions it), and a data_parallel_group,
    zero_param_parallel_group, sequence_data_parallel_group or mpu (the
    pieces are partitioned over the whole world), quantized weights."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None, param_swapper=None):
        if module is not None:
            raise NotImplementedError(
                "deepspeed.zero.Init(module=...): partitioning a model built already is not "
                "supported; build it inside `with deepspeed.zero.Init():` instead (zero."
                "initialize at stage 3 partitions a whole model too)")
        for name, value in (("data_parallel_group", data_parallel_group), ("mpu", mpu),
                            ("zero_param_parallel_group", zero_param_parallel_group),
                            ("sequence_data_parallel_group", sequence_data_parallel_group)):
            if value is not None:
                raise NotImplementedError(
                    f"deepspeed.zero.Init({name}=...): zero partitions a model under "
                    "construction over the whole world only; leave it out")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise NotImplementedError("deepspeed.zero.Init: quantized weights (ZeRO++) are "
                                      "not supported")
        self.enabled = enabled
        self.nvme_path = None
        block = _offload_param(config_dict_or_path if config_dict_or_path is not None
                               else config)
        if remote_device == "nvme" or (block is not None and block.device == "nvme"):
            if block is None or block.nvme_path is None:
                raise ValueError("deepspeed.zero.Init(remote_device='nvme') needs the config's "
                                 "zero_optimization.offload_param.nvme_path")
            self.nvme_path = block.nvme_path
        self._context = None

    def __enter__(self):
        self._context = partitioned_init(nvme_path=self.nvme_path) if self.enabled \
            else contextlib.nullcontext()
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


def _offload_param(config):
    """The config's offload_param block, or None."""
    if config is None:
        return None
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    return Config.from_deepspeed(config).offload_param if isinstance(config, dict) else None


def GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True):
    """deepspeed.zero.GatheredParameters: zero's, with DeepSpeed's
    arguments (fwd_module is accepted: zero gathers for forwards itself)."""
    return _Gathered(params, modifier_rank=modifier_rank, enabled=enabled)
