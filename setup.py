"""Build of zero's C extension, zero._C.

The extension builds against CPython headers alone: no torch at build time
(DESIGN.md), no -march=native (SIMD paths are chosen at run time from the
x86/ variants, which carry their own target attributes).
"""
import platform
from pathlib import Path

from setuptools import Extension, setup

ROOT = Path(__file__).parent


def core_sources():
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.c"))
    if platform.machine().lower() in ("x86_64", "amd64"):
        sources += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "x86").glob("*.c"))
    return sources


extension = Extension(
    "zero._C",
    sources=core_sources(),
    include_dirs=["csrc"],
    extra_compile_args=["-std=c11", "-O3", "-fvisibility=hidden", "-Wall", "-Wextra",
                        "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
    libraries=["m", "dl"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[extension])
