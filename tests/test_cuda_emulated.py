"""tests/gpu on a machine without a GPU: the emulated driver
(tests/emulated_cuda, `make emulated-cuda`) runs the kernels' own source on
the CPU, so the binding, the launcher (argument blocks, launch splitting,
contexts) and the kernels' logic are all checked against the references
here. What it cannot check is the GPU itself (docs/cuda.md).

The suite runs in a fresh process: the driver a process loads first is the
one it keeps, and this one (ZERO_CUDA_DRIVER) must not be it for the rest
of the tests."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zero import _C

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "tests" / "c" / "build" / "libzero_fake_cuda.so"


@pytest.fixture(scope="module")
def emulated_driver():
    if _C.cuda_info()["fatbin_bytes"] == 0:
        pytest.skip("zero was built without nvcc: no kernels to launch, even emulated")
    if not shutil.which(os.environ.get("CXX", "g++")) or not shutil.which("make"):
        pytest.skip("the emulated driver needs make and a C++ compiler")
    subprocess.run(["make", "-s", "emulated-cuda"], cwd=ROOT, check=True)
    return LIBRARY


def run_emulated(library, *pytest_args):
    env = {**os.environ, "ZERO_CUDA_DRIVER": str(library), "ZERO_TEST_EMULATED_CUDA": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT / "tests")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *pytest_args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def test_gpu_suite_passes_on_the_emulated_driver(emulated_driver):
    out = run_emulated(emulated_driver, "tests/gpu", "-rs")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", out.stdout).group(1))
    skipped = re.findall(r"SKIPPED \[\d+\] (.*)", out.stdout)
    assert passed >= 40, out.stdout[-2000:]
    # only the checks of the real driver and of real CUDA tensors may skip
    assert all("real driver" in reason or "needs CUDA tensors" in reason
               for reason in skipped), skipped
