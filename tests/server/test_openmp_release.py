"""release_openmp_threads: the calling thread's OpenMP workers end, and its parallel ops still run (on a new team)
with the same results."""
import os
import threading
import time

import pytest
import torch

from specdec.kernels import ops
from specdec.server.engine_loop import release_openmp_threads


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled_thread_count(at_most: int, timeout_s: float = 5.0) -> int:
    """The process's thread count once it is ``at_most`` or fewer (workers end asynchronously), or the last count."""
    deadline = time.monotonic() + timeout_s
    count = _thread_count()
    while count > at_most and time.monotonic() < deadline:
        time.sleep(0.01)
        count = _thread_count()
    return count


def test_release_ends_the_calling_threads_workers():
    if not os.path.exists(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")):
        pytest.skip("this torch has no libgomp of its own: nothing to release")
    if not ops.kernels_available():
        pytest.skip("the kernels are not built: no parallel region of ours to run")
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # a second thread runs parallel regions (as the engine thread does) and keeps its team while it lives
        team_ready, done = threading.Event(), threading.Event()

        def engine_thread():
            assert ops._load().parallel_threads(64) == 2
            team_ready.set()
            done.wait(30)

        worker = threading.Thread(target=engine_thread)
        worker.start()
        team_ready.wait(30)
        assert ops._load().parallel_threads(64) == 2  # this thread's own team: one more worker
        with_both_teams = _thread_count()
        assert release_openmp_threads()
        assert _settled_thread_count(with_both_teams - 1) <= with_both_teams - 1  # this thread's worker ended
        done.set()
        worker.join()
        # and the released thread still runs parallel regions on 2 threads, with a new team
        assert ops._load().parallel_threads(64) == 2
        a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
        assert torch.equal(a @ a, a @ a)
    finally:
        torch.set_num_threads(old)
