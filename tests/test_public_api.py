"""The public surface is frozen: a change to it must change this test too,
on purpose (and README/docs with it)."""
import zero


def test_top_level_names():
    assert sorted(zero.__all__) == sorted([
        "initialize", "inference", "estimate_memory", "settings_that_fit", "Engine", "Config",
        "LossScaling",
        "GatheredParameters",
        "partitioned_init", "optim", "checkpoint", "parallel", "rlhf", "cpu_info",
        "get_num_threads",
        "set_num_threads"])
    for name in zero.__all__:
        assert hasattr(zero, name)


def test_optimizer_names():
    assert sorted(zero.optim.__all__) == ["Adagrad", "Adam", "AdamW", "Lion", "SGD"]


def test_parallel_names():
    assert sorted(zero.parallel.__all__) == [
        "causal_lm_loss", "gpt2_plan", "gpt_loss", "gpt_plan", "llama_plan", "parallelize_gpt",
        "parallelize_gpt2", "parallelize_llama", "pipeline_schedule", "split_gpt", "split_llama"]


def test_checkpoint_names():
    assert zero.checkpoint.__all__ == ["consolidate", "convert_deepspeed"]
    for method in ("save_checkpoint", "load_checkpoint", "full_state_dict"):
        assert callable(getattr(zero.Engine, method))


def test_core_functions():
    expected = {"Buffer", "adam_step", "sgd_step", "lion_step", "adagrad_step", "sum_squares",
                "all_finite", "convert", "stream_triad", "cpu_info", "set_simd",
                "set_num_threads", "get_num_threads", "cuda_available", "cuda_info",
                "cuda_adam_step", "cuda_multi_tensor_adam", "cuda_norm_partials",
                "cuda_l2_norm", "cuda_unscale_check", "cuda_pack", "cuda_unpack"}
    assert expected <= set(dir(zero._C))


def test_import_pulls_in_no_framework():
    """zero.integrations.hf imports transformers only when imported itself."""
    import subprocess
    import sys
    code = "import sys, zero, zero.integrations; print('transformers' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
