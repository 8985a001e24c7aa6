"""Builds the CPU kernels with the package (``pip install -e .`` or ``pip install .``): ``specdec.kernels._q8``.

Metadata lives in pyproject.toml; this file only adds the extension. Its sources, flags and digest come from
``src/specdec/kernels/build_spec.py``, which the development build (torch's JIT ``load``, kernels/build.py) reads
too, and the command line is the JIT build's: setuptools' own compiler flags (Python's CFLAGS: -g -fwrapv -Wall
-DNDEBUG ...) are dropped, so the compiler sees exactly torch's includes and defines, -fPIC -std=c++20 and
``-O3 -ffp-contract=off -fopenmp``. The kernel paths (scalar, avx2, avx512, amx) are chosen at run time inside the
one binary. Beside the module goes ``_build_info.py`` with the digest of the sources, torch version and flags it
was built from: specdec imports the module only while that digest is the sources' on disk.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import shutil
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

KERNELS = Path("src", "specdec", "kernels")


def _load_build_spec():
    spec = importlib.util.spec_from_file_location("specdec_build_spec", KERNELS / "build_spec.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SPEC = _load_build_spec()


def _recorded_digest(info: Path) -> str | None:
    """The DIGEST line of a generated _build_info.py (read as text: it is not importable at build time)."""
    if not info.exists():
        return None
    for line in info.read_text().splitlines():
        if line.startswith("DIGEST = "):
            return line.split("'")[1]
    return None


def _replace(source: str, target: Path) -> None:
    """Copy then rename: a process that has the old module mapped keeps reading its old file."""
    temporary = target.with_name(target.name + ".tmp")
    shutil.copyfile(source, temporary)
    shutil.copymode(source, temporary)
    os.replace(temporary, target)


def _write_info(target: Path, digest: str) -> None:
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_text(SPEC.build_info_text(digest, torch.__version__))
    os.replace(temporary, target)


class BuildKernels(BuildExtension):
    def build_extensions(self) -> None:
        # the JIT build's command line: the compiler and -fPIC, then torch's includes and defines and our flags
        self.compiler.set_executable("compiler_so", [self.compiler.compiler_so[0], "-fPIC"])
        super().build_extensions()

    def build_extension(self, ext) -> None:
        digest = SPEC.digest(torch.__version__, KERNELS)
        built = Path(self.get_ext_fullpath(ext.name))
        in_place = self._in_place_file(ext)
        if in_place is not None and _recorded_digest(in_place.with_name(SPEC.BUILD_INFO)) == digest:
            # an editable reinstall of unchanged sources: keep the module already built beside them
            built.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(in_place, built)
        else:
            self.force = self.force or _recorded_digest(built.with_name(SPEC.BUILD_INFO)) != digest
            super().build_extension(ext)
        _write_info(built.with_name(SPEC.BUILD_INFO), digest)

    def _in_place_file(self, ext) -> Path | None:
        """Where an editable install keeps the module (beside its sources), when it is there."""
        if not (self.editable_mode or self.inplace):
            return None
        in_place, _ = self._get_inplace_equivalent(self.get_finalized_command("build_py"), ext)
        return Path(in_place) if Path(in_place).exists() else None

    def copy_extensions_to_source(self) -> None:
        """Editable installs: the module and its build info beside the sources, each replaced by a rename."""
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            in_place, built = self._get_inplace_equivalent(build_py, ext)
            _replace(built, Path(in_place))
            _replace(str(Path(built).with_name(SPEC.BUILD_INFO)), Path(in_place).with_name(SPEC.BUILD_INFO))


def _extensions() -> list:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []  # the kernels are x86-64 code; elsewhere specdec runs its torch fallback (and says so)
    headers = sorted(str(path) for path in (KERNELS / SPEC.HEADER_DIR).glob("*.h"))
    return [CppExtension(SPEC.MODULE, [str(KERNELS / SPEC.TRANSLATION_UNIT)], depends=headers,
                         extra_compile_args=list(SPEC.CFLAGS), extra_link_args=list(SPEC.LDFLAGS))]


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildKernels})
