"""The runtime around the kernels: SIMD choice (environment and code),
thread pool, fork safety, and no CUDA at import."""
import multiprocessing as mp
import os
import subprocess
import sys

import pytest
import torch

import zero


def run_python(code, **env):
    full_env = {**os.environ, **env}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=full_env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def test_cpu_info_reports_path_and_features():
    info = zero.cpu_info()
    assert info["simd"] in info["available"]
    assert info["best"] == info["available"][-1]
    assert "scalar" in info["available"]
    assert info["simd_env_var"] == "ZERO_SIMD"
    assert info["threads"] >= 1


@pytest.mark.parametrize("path", zero.cpu_info()["available"])
def test_environment_forces_path(path):
    out = run_python("import zero; print(zero.cpu_info()['simd'])", ZERO_SIMD=path)
    assert out.stdout.strip() == path


def test_unknown_environment_value_warns_and_falls_back():
    out = run_python("import warnings; warnings.simplefilter('always');"
                     "import zero; print(zero.cpu_info()['simd'])", ZERO_SIMD="avx9000")
    assert "ZERO_SIMD=avx9000 is not a SIMD path" in out.stderr
    assert f"this CPU runs {', '.join(zero.cpu_info()['available'])}" in out.stderr
    assert out.stdout.strip() == zero.cpu_info()["best"]


def test_import_creates_no_cuda_context():
    out = run_python("import torch, zero; m = torch.nn.Linear(4, 4);"
                     "o = zero.optim.AdamW(m.parameters()); m(torch.randn(2, 4)).sum().backward();"
                     "o.step(); print(torch.cuda.is_initialized())")
    assert out.stdout.strip() == "False"


def test_thread_count_does_not_change_results():
    n = 1 << 20
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=g)
    results = []
    old = zero.get_num_threads()
    try:
        for threads in (1, 2, 3):
            zero.set_num_threads(threads)
            assert zero.get_num_threads() == threads
            p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
            zero._C.adam_step(p, grad, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.01, step=1)
            results.append((p, zero._C.sum_squares(grad)))
    finally:
        zero.set_num_threads(0 if old == os.cpu_count() else old)
    for p, s in results[1:]:
        assert torch.equal(p, results[0][0]) and s == results[0][1]


def _child_step(queue, p, g, m, v):
    # Only our core runs in the child: torch's own OpenMP pool is not
    # fork-safe, so the tensors were made in the parent.
    zero._C.adam_step(p, g, m, v, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.0, step=1)
    queue.put(float(p[0]))


def test_pool_survives_fork():
    """A forked child (a DataLoader worker) has none of the parent's worker
    threads; its first parallel call must start new ones, not hang."""
    zero.set_num_threads(2)
    n = 1 << 20
    zero._C.sum_squares(torch.ones(n))  # the parent's pool is running
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    tensors = (torch.ones(n), torch.full((n,), 0.5), torch.zeros(n), torch.zeros(n))
    child = ctx.Process(target=_child_step, args=(queue, *tensors))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0, "child hung or failed"
    assert abs(queue.get(timeout=5) - 0.9) < 1e-6  # p - lr * m_hat / sqrt(v_hat)
    zero.set_num_threads(0)


def test_ranks_on_one_machine_share_its_cores():
    """Under a launcher with LOCAL_WORLD_SIZE ranks a machine, initialize
    gives the C core this rank's share of the CPUs, unless the user chose a
    count first."""
    code = ("import os, torch, zero; cpus = len(os.sched_getaffinity(0));"
            "{before}"
            "zero.initialize(torch.nn.Linear(4, 4), stage=0);"
            "print(cpus, zero.get_num_threads())")
    out = run_python(code.format(before=""), LOCAL_WORLD_SIZE="2")
    cpus, threads = map(int, out.stdout.split())
    assert threads == max(1, cpus // 2)
    out = run_python(code.format(before="zero.set_num_threads(3);"), LOCAL_WORLD_SIZE="2")
    assert out.stdout.split()[1] == "3"
    out = run_python(code.format(before=""), LOCAL_WORLD_SIZE="1")
    cpus, threads = map(int, out.stdout.split())
    assert threads == cpus
    # DeepSpeed's launcher names the count LOCAL_SIZE
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_WORLD_SIZE"}
    out = subprocess.run([sys.executable, "-c", code.format(before="")], capture_output=True,
                         text=True, env={**env, "LOCAL_SIZE": "2"}, timeout=120)
    cpus, threads = map(int, out.stdout.split())
    assert threads == max(1, cpus // 2), out.stderr


@pytest.mark.parametrize("machine, bound, local, expected", [
    (16, 16, 8, 2),   # eight GPU ranks on a 16-core node
    (16, 16, 3, 5),
    (4, 4, 8, 1),     # more ranks than cores: one each
    (16, 4, 4, 4),    # the launcher bound the rank to 4 cores: all of them
])
def test_core_share_rule(monkeypatch, machine, bound, local, expected):
    from zero.step import _threads
    calls = []
    monkeypatch.setattr(_threads, "_chosen", False)
    monkeypatch.setattr(_threads.os, "cpu_count", lambda: machine)
    monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: set(range(bound)))
    monkeypatch.setattr(_threads._C, "set_num_threads", calls.append)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    _threads.share_cores_among_local_ranks()
    assert calls == ([] if expected == bound else [expected])
