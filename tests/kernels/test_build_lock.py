"""Finding the kernels (kernels/build.py): a current installed build or a completed development build is imported
without a lock or a compile; a development build compiles once under our flock, which a killed holder never leaves
behind (nor torch's own lock file), and a live holder is waited for, with a line on stderr, up to a time limit.
The compile step is replaced by a stub: no test here runs the compiler."""
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from specdec.kernels import build


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty kernel cache, no installed build, and a compile stub that records its calls."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(build.TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(build, "installed_digest", lambda: None)
    monkeypatch.setattr(build, "_import_library", lambda name, path: types.ModuleType(name))
    compiled = []

    def compile_stub(directory, digest, verbose):
        assert not (directory / build.TORCH_LOCK_FILE).exists(), "torch's load() would wait for that lock forever"
        (directory / f"{build.jit_module_name(digest)}.so").write_bytes(b"")
        compiled.append(directory)
        return types.ModuleType(build.jit_module_name(digest))

    monkeypatch.setattr(build, "_compile", compile_stub)
    return types.SimpleNamespace(directory=build.jit_build_dir(build.source_digest()), compiled=compiled)


def forbid(monkeypatch, *names):
    for name in names:
        monkeypatch.setattr(build, name, lambda *args, **kwargs: pytest.fail(f"{name} was called"))


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from specdec.kernels import build
    directory = Path(sys.argv[1])
    with build.build_lock(directory):
        (directory / build.TORCH_LOCK_FILE).write_text("")  # what torch's load() holds while it compiles
        print("locked", flush=True)
        time.sleep(float(sys.argv[2]))
        if sys.argv[3] == "finish":  # a build that completes: the waiter imports it
            (directory / (build.jit_module_name(sys.argv[4]) + ".so")).write_bytes(b"")
            (directory / build.COMPLETE_FILE).write_text(sys.argv[4])
            (directory / build.TORCH_LOCK_FILE).unlink()
""")


def hold_lock(directory: Path, seconds: float, finish: bool = False) -> subprocess.Popen:
    """A process holding the build lock of `directory` (and torch's lock file in it) for `seconds`."""
    directory.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), str(seconds),
                               "finish" if finish else "hold", directory.name], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_current_installed_build_is_imported_without_a_lock_or_a_compile(monkeypatch, cache):
    monkeypatch.setattr(build, "installed_digest", build.source_digest)
    monkeypatch.setattr(build, "_import_installed", lambda: types.ModuleType("specdec.kernels._q8"))
    forbid(monkeypatch, "build_lock", "_compile")
    module = build.load_extension()
    assert (module.build_origin, module.build_digest) == ("installed", build.source_digest())
    assert not cache.directory.exists()  # nothing written: no lock file, no build.ninja


def test_a_completed_development_build_is_imported_without_a_lock(monkeypatch, cache):
    cache.directory.mkdir(parents=True)
    (cache.directory / f"{build.jit_module_name(build.source_digest())}.so").write_bytes(b"")
    (cache.directory / build.COMPLETE_FILE).write_text("")
    forbid(monkeypatch, "build_lock", "_compile")
    module = build.load_extension()
    assert module.build_origin == str(cache.directory)
    assert sorted(path.name for path in cache.directory.iterdir()) == sorted(
        [build.COMPLETE_FILE, f"{build.jit_module_name(build.source_digest())}.so"])


def test_sources_edited_since_the_installed_build_are_compiled_once(monkeypatch, cache, capsys):
    monkeypatch.setattr(build, "installed_digest", lambda: "0123456789abcdef")  # an edit after pip install -e
    forbid(monkeypatch, "_import_installed")
    first = build.load_extension()
    assert cache.compiled == [cache.directory] and first.build_digest == build.source_digest()
    assert "the sources differ from the installed build's (0123456789abcdef)" in capsys.readouterr().err
    second = build.load_extension()  # the next start: the completed build, no second compile
    assert cache.compiled == [cache.directory] and second.build_origin == str(cache.directory)


def test_a_killed_build_leaves_no_lock_behind(cache, capsys):
    holder = hold_lock(cache.directory, seconds=60)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (cache.directory / build.TORCH_LOCK_FILE).exists()  # what a killed torch load() leaves
    started = time.monotonic()
    build.load_extension()
    assert time.monotonic() - started < 5
    assert cache.compiled == [cache.directory]  # the stub checked that torch's lock file was gone
    err = capsys.readouterr().err
    assert "waiting" not in err and "left by an interrupted kernel build" in err


def test_a_live_build_is_waited_for_then_given_up_with_a_clear_error(monkeypatch, cache, capsys):
    monkeypatch.setenv(build.TIMEOUT_ENV, "0.5")
    holder = hold_lock(cache.directory, seconds=60)
    try:
        started = time.monotonic()
        with pytest.raises(build.KernelBuildTimeout, match=f"gave up after 0.5 s waiting for process {holder.pid}"):
            build.load_extension()
        assert 0.5 <= time.monotonic() - started < 5
    finally:
        holder.kill()
        holder.wait()
    assert (f"[waiting for another process building the specdec kernels (pid {holder.pid}) ... at most 0.5 s "
            f"({build.TIMEOUT_ENV})]") in capsys.readouterr().err
    assert cache.compiled == []


def test_a_live_build_that_completes_is_imported_not_compiled_again(cache, capsys):
    holder = hold_lock(cache.directory, seconds=0.5, finish=True)
    module = build.load_extension()
    holder.wait()
    assert cache.compiled == [] and module.build_origin == str(cache.directory)
    assert f"(pid {holder.pid})" in capsys.readouterr().err


def test_the_time_limit_must_be_seconds(monkeypatch):
    monkeypatch.setenv(build.TIMEOUT_ENV, "ten minutes")
    with pytest.raises(ValueError, match=build.TIMEOUT_ENV):
        build.build_timeout_s()
    monkeypatch.setenv(build.TIMEOUT_ENV, "30")
    assert build.build_timeout_s() == 30.0

