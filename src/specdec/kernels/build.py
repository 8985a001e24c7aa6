"""Finding the compiled CPU kernels: the build installed with the package, else a development build.

``pip install`` (``setup.py``) compiles ``specdec.kernels._q8`` and writes beside it ``_build_info.py`` with the digest
of the sources, torch version and flags it was built from (``build_spec.digest``). A process imports that module when
its digest is the digest of the sources on disk: no compiler, no lock, no file written.

Otherwise -- no installed build (a checkout without ``pip install``), or a stale one (an engineer edited
``q8_kernels.cpp`` or ``csrc/*.h`` in an editable install, or torch changed) -- it compiles the sources with torch's
JIT ``load`` into ``$XDG_CACHE_HOME/specdec/kernels/<digest>`` once per digest, and later starts import the
completed build there directly (again without a lock or a rewritten ``build.ninja``).

The lock. A JIT compile runs under our own ``flock`` on ``specdec-build.lock`` in its build directory, holding the
holder's pid. The kernel releases a flock when its holder dies, so a build killed half-way never blocks the next
one; and once we hold it, torch's own ``lock`` file there (which torch's ``load`` would wait for forever) can only
be left by a dead build, and is removed. A live holder is waited for with a line on stderr, for at most
``SPECDEC_KERNEL_BUILD_TIMEOUT`` seconds (default 600), then :class:`KernelBuildTimeout` says who holds it.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from specdec.kernels import build_spec

LOCK_FILE = "specdec-build.lock"  # our flock; its content is the holder's pid
TORCH_LOCK_FILE = "lock"  # torch.utils.cpp_extension's FileBaton
COMPLETE_FILE = "complete"  # written after load() returned: the build in this directory is whole
TIMEOUT_ENV = "SPECDEC_KERNEL_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
_BUILD_INFO_MODULE = build_spec.MODULE.rsplit(".", 1)[0] + "." + Path(build_spec.BUILD_INFO).stem


class KernelBuildTimeout(RuntimeError):
    """Another live process held the build lock for longer than the time limit."""


@functools.cache
def source_digest() -> str:
    """The digest of the kernel sources on disk with this torch and the flags (read once per process)."""
    return build_spec.digest(torch.__version__)


def installed_digest() -> str | None:
    """The digest the installed build was made from, None when the package was installed without one."""
    try:
        info = importlib.import_module(_BUILD_INFO_MODULE)
    except ImportError:
        return None
    return getattr(info, "DIGEST", None)


def jit_build_dir(digest: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "specdec", "kernels", digest)


def jit_module_name(digest: str) -> str:
    return f"specdec_q8_{digest}"


def load_extension(verbose: bool = False) -> ModuleType:
    """The kernel module for the sources on disk, tagged with ``build_digest`` and ``build_origin`` ("installed", or
    the directory of its development build). Raises when it cannot be built."""
    digest = source_digest()
    installed = installed_digest()
    if installed == digest:
        try:
            return _tagged(_import_installed(), digest, "installed")
        except ImportError as exc:
            reason = f"the installed build failed to import ({exc})"
    elif installed is None:
        reason = "no installed build (pip install -e . builds one)"
    else:
        reason = f"the sources differ from the installed build's ({installed})"
    directory = jit_build_dir(digest)
    module = _import_complete(directory, digest)
    if module is None:
        module = _jit_build(directory, digest, reason, verbose)
    return _tagged(module, digest, str(directory))


def _import_installed() -> ModuleType:
    return importlib.import_module(build_spec.MODULE)


def _tagged(module: ModuleType, digest: str, origin: str) -> ModuleType:
    module.build_digest = digest
    module.build_origin = origin
    return module


def _import_complete(directory: Path, digest: str) -> ModuleType | None:
    """The completed development build in ``directory``, imported without torch's ``load`` (no lock, no ninja)."""
    library = directory / f"{jit_module_name(digest)}.so"
    if not (directory / COMPLETE_FILE).exists() or not library.exists():
        return None
    return _import_library(jit_module_name(digest), library)


def _import_library(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jit_build(directory: Path, digest: str, reason: str, verbose: bool) -> ModuleType:
    directory.mkdir(parents=True, exist_ok=True)
    with build_lock(directory):
        module = _import_complete(directory, digest)  # built by the process we waited for
        if module is not None:
            return module
        _remove_stale_torch_lock(directory)
        print(f"[compiling the specdec kernels into {directory}: {reason}; once per source version, "
              "about a minute ...]", file=sys.stderr, flush=True)
        started = time.perf_counter()
        module = _compile(directory, digest, verbose)
        (directory / COMPLETE_FILE).write_text(f"{digest}\n")
        print(f"[compiled the specdec kernels in {time.perf_counter() - started:.0f} s]", file=sys.stderr, flush=True)
        return module


def _compile(directory: Path, digest: str, verbose: bool) -> ModuleType:
    from torch.utils.cpp_extension import load

    return load(name=jit_module_name(digest), sources=[str(build_spec.sources()[0])],
                extra_cflags=list(build_spec.CFLAGS), extra_ldflags=list(build_spec.LDFLAGS),
                build_directory=str(directory), verbose=verbose)


def _remove_stale_torch_lock(directory: Path) -> None:
    """Under our flock every live builder of this directory is us: a torch lock file here is a dead build's."""
    stale = directory / TORCH_LOCK_FILE
    if stale.exists():
        stale.unlink(missing_ok=True)
        print(f"[removed {stale}, left by an interrupted kernel build]", file=sys.stderr, flush=True)


def build_timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV, "")
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{TIMEOUT_ENV}={value!r}: give the seconds to wait for another kernel build (e.g. 600)")
    return seconds


@contextlib.contextmanager
def build_lock(directory: Path, timeout_s: float | None = None, poll_s: float = 0.1):
    """Holds the flock of ``directory``'s builds; waits for a live holder at most ``timeout_s`` (default: the env's
    limit), saying so on stderr, then raises :class:`KernelBuildTimeout`."""
    timeout_s = build_timeout_s() if timeout_s is None else timeout_s
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, timeout_s, poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def _acquire(fd: int, path: Path, timeout_s: float, poll_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        holder = _holder(path)
        if not waiting:
            print(f"[waiting for another process building the specdec kernels (pid {holder}) ... at most "
                  f"{timeout_s:g} s ({TIMEOUT_ENV})]", file=sys.stderr, flush=True)
            waiting = True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise KernelBuildTimeout(
                f"gave up after {timeout_s:g} s waiting for process {holder}, which holds {path} while it builds the "
                f"specdec kernels; if that process is stuck, end it, or set {TIMEOUT_ENV}=SECONDS to wait longer")
        time.sleep(min(poll_s, remaining))


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"
