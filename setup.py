"""Build gem_mpi and its C++ extension gem_mpi.algorithm._core through CMake.

    pip install .                          # isolated build: fetches setuptools, pybind11, cmake
    pip install --no-build-isolation .     # uses the current environment's build tools

GEM_MPI_NATIVE=1 in the environment builds the kernels with -march=native.
CMAKE_BUILD_PARALLEL_LEVEL is honoured; GEM_MPI_CMAKE_ARGS adds extra configure arguments.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PACKAGE = "gem_mpi"


def read_version() -> str:
    text = (ROOT / PACKAGE / "version.py").read_text(encoding="utf-8")
    match = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", text, re.MULTILINE)
    if not match:
        raise RuntimeError(f"no __version__ = '...' line in {PACKAGE}/version.py")
    return match.group(1)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "on", "true", "yes"}


def find_cmake() -> str:
    """The cmake of the `cmake` Python package when installed (build isolation), else PATH."""
    try:
        import cmake  # type: ignore[import-not-found]

        candidate = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        if candidate.exists() or candidate.with_suffix(".exe").exists():
            return str(candidate)
    except (ImportError, AttributeError):
        pass
    found = shutil.which("cmake")
    if not found:
        raise RuntimeError("cmake >= 3.18 is needed to build gem_mpi.algorithm._core: pip install cmake")
    return found


class CMakeExtension(Extension):
    """An extension that CMake builds from `sourcedir`.

    `sources` and `depends` are not compiled by setuptools; listing them (and
    CMakeLists.txt) puts them into an sdist, so that a wheel built from it works too.
    """

    def __init__(self, name: str, sourcedir: Path = ROOT) -> None:
        sources = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").glob("*.cpp"))
        headers = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").glob("*.hpp"))
        super().__init__(name, sources=sources, depends=[*headers, "CMakeLists.txt"])
        self.sourcedir = Path(sourcedir).resolve()


class CMakeBuild(build_ext):
    """Configure and build with CMake in build_temp, then copy _core* to the package dir."""

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        import pybind11

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = Path(self.build_temp).resolve() / f"cmake-{ext.name}"
        out_dir = build_dir / "out"
        config = "Debug" if self.debug else "Release"
        native = env_flag("GEM_MPI_NATIVE")

        configure = [
            f"-DCMAKE_BUILD_TYPE={config}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY_{config.upper()}={out_dir}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DPYTHON_EXECUTABLE={sys.executable}",
            f"-DGEM_MPI_VERSION={read_version()}",
            f"-DGEM_MPI_NATIVE={'ON' if native else 'OFF'}",
        ]
        configure += shlex.split(os.environ.get("GEM_MPI_CMAKE_ARGS", ""))

        # A cache made by another interpreter, source tree or build environment (an
        # isolated build's pybind11 lives in a temporary directory) is not reusable.
        stamp = build_dir / "gem_mpi_configure.txt"
        signature = "\n".join([str(ext.sourcedir), *configure])
        if build_dir.exists() and (
            not stamp.exists() or stamp.read_text(encoding="utf-8") != signature
        ):
            shutil.rmtree(build_dir)
        build_dir.mkdir(parents=True, exist_ok=True)

        cmake = find_cmake()
        if not (build_dir / "CMakeCache.txt").exists():
            self._run([cmake, "-S", str(ext.sourcedir), "-B", str(build_dir), *configure])
            stamp.write_text(signature, encoding="utf-8")

        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        self._run([cmake, "--build", str(build_dir), "--config", config, "--parallel", jobs])

        suffix = Path(target.name).suffix  # .so / .pyd
        built = sorted(out_dir.glob(f"_core*{suffix}"))
        if len(built) != 1:
            raise RuntimeError(f"expected one _core*{suffix} in {out_dir}, found {built}")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], target)
        shutil.copymode(built[0], target)

    @staticmethod
    def _run(cmd: list[str]) -> None:
        print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
        subprocess.run(cmd, check=True)


class CleanBuildPy(build_py):
    """Drop the previous build/lib copy of the package first, so a module deleted from
    the source tree is not installed again from a stale in-tree build directory."""

    def run(self) -> None:
        if not getattr(self, "editable_mode", False) and not self.dry_run:
            stale = Path(self.build_lib).resolve() / PACKAGE
            if stale.is_dir() and stale != (ROOT / PACKAGE):
                shutil.rmtree(stale)
        super().run()


setup(
    name="gem_mpi",
    version=read_version(),
    description=(
        "Asynchronous distributed PyTorch training over MPI one-sided RMA "
        "with Gradient Energy Matching"
    ),
    packages=find_packages(include=["gem_mpi", "gem_mpi.*"]),
    python_requires=">=3.11",
    install_requires=["numpy", "h5py", "mpi4py", "tqdm", "tomli-w", "safetensors"],
    extras_require={"live": ["tensorboard", "wandb"]},  # --tensorboard, --wandb
    ext_modules=[CMakeExtension("gem_mpi.algorithm._core")],
    cmdclass={"build_ext": CMakeBuild, "build_py": CleanBuildPy},
    zip_safe=False,
)
