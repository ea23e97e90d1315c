"""`release_openmp_threads` ends the calling thread's OpenMP team: the helper threads libgomp started for it exit,
so that a decoding thread started afterwards is the process's only team (`metasd.openmp`)."""

import os
import threading
import time

import pytest
import torch

from metasd.openmp import _libgomp, release_openmp_threads


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_releasing_a_threads_openmp_team_ends_its_helper_threads():
    if _libgomp() is None:
        pytest.skip("torch runs on another OpenMP runtime here")
    seen: dict[str, object] = {}

    def work():  # a thread of its own: its team is its own, whatever the test runner's thread holds
        torch.set_num_threads(2)
        a = torch.randn(256, 256)
        for _ in range(3):
            (a @ a).add_(torch.ones(2_000_000).sum())  # parallel regions: the thread's team of two
        seen["with_team"] = _threads()
        seen["before"] = float((a @ a).sum())
        seen["released"] = release_openmp_threads()
        deadline = time.monotonic() + 5
        while _threads() >= seen["with_team"] and time.monotonic() < deadline:
            time.sleep(0.01)  # the helpers exit on their own schedule
        seen["after"] = _threads()
        seen["after_release"] = float((a @ a).sum())  # torch still runs: the thread gets a new team when it needs one

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["released"] is True
    assert seen["after"] < seen["with_team"], seen
    assert seen["after_release"] == seen["before"]  # the same product, computed by the thread's new team
