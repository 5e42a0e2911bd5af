"""Build of zero's C extension, zero._C.

The extension builds against CPython headers alone: no torch at build time
(DESIGN.md), no -march=native (SIMD paths are chosen at run time from the
x86/ variants, which carry their own target attributes). Where nvcc is found
(PATH or $CUDA_HOME/bin; ZERO_NO_CUDA=1 skips it) the CUDA kernels are built
into a fatbin that is embedded in the extension as a byte array; there is no
link against CUDA either way (docs/cuda.md).
"""
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "kernels"))
import nvcc_build  # noqa: E402  (kernels/nvcc_build.py: nvcc's flags, once)


def core_sources():
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.c"))
    if platform.machine().lower() in ("x86_64", "amd64"):
        sources += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "x86").glob("*.c"))
    return sources


extension = Extension(
    "zero._C",
    sources=core_sources(),
    include_dirs=["csrc", "include"],
    depends=[str(p.relative_to(ROOT)) for p in
             sorted((ROOT / "csrc").rglob("*.h")) + sorted((ROOT / "include").rglob("*.h"))],
    extra_compile_args=["-std=c11", "-O3", "-fvisibility=hidden", "-Wall", "-Wextra",
                        "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
    libraries=["m", "dl"],
    extra_link_args=["-pthread"],
)


class build_ext_with_kernels(build_ext):
    """Adds the generated C file that embeds the kernels' fatbin (an empty
    one without nvcc) to the extension's sources. A kernel that fails to
    compile, or warns, fails the build: set ZERO_NO_CUDA=1 to build
    without the CUDA kernels."""

    def build_extensions(self):
        embedded = str(nvcc_build.embed(Path(self.build_temp)))
        for ext in self.extensions:
            if embedded not in ext.sources:
                ext.sources.append(embedded)
        super().build_extensions()


setup(ext_modules=[extension], cmdclass={"build_ext": build_ext_with_kernels})
