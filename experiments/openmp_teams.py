"""A second thread's small matmuls while the main thread's OpenMP team is alive, and after it was released.

torch's CPU wheels use libgomp, which keeps a team of helper threads per thread that opened a parallel region, and
shortens its spin-wait at barriers while the teams' threads outnumber the CPUs (`metasd.openmp`). A server decodes
on a thread of its own after the main thread loaded the models: this measures one [8, 576] x [576, 1536] matmul (a
projection of the embedded model at eight rows) on the main thread, on a second thread while the main thread's team
is alive, and on a second thread after `release_openmp_threads()` on the main thread; medians of 5 repetitions of
3,000 calls, in microseconds.
Usage: python experiments/openmp_teams.py
"""

import statistics
import threading
import time

import torch

from metasd.openmp import release_openmp_threads

THREADS = torch.get_num_threads()
weight, rows = torch.randn(576, 1536), torch.randn(8, 576)


def per_call_us() -> float:
    for _ in range(200):
        rows @ weight
    times = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(3000):
            rows @ weight
        times.append((time.perf_counter() - started) / 3000 * 1e6)
    return statistics.median(times)


def on_a_thread() -> float:
    out = []

    def run():
        torch.set_num_threads(THREADS)
        out.append(per_call_us())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0]


if __name__ == "__main__":
    print(f"torch threads: {THREADS}")
    print(f"main thread:                            {per_call_us():7.1f} us")
    print(f"second thread, main's team alive:       {on_a_thread():7.1f} us")
    print(f"main's team released: {release_openmp_threads()}")
    print(f"second thread, main's team released:    {on_a_thread():7.1f} us")
