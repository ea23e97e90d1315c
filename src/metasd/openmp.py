"""The OpenMP threads behind torch's CPU kernels, when one thread builds the models and another decodes.

torch's CPU wheels run their parallel regions on GNU OpenMP (libgomp), which gives every thread that opens a parallel
region its own team of helper threads and keeps that team until the thread exits. While the teams' threads outnumber
the CPUs, libgomp cuts the spin-wait at its barriers from about 300,000 iterations to 100 (`do_spin` in libgomp's
`config/linux/wait.h`: `gomp_managed_threads > gomp_available_cpus`), so every parallel region ends in futex
sleeps and wake-ups. A server's decoding thread (`metasd.serving`) is exactly that second team: the thread that
loaded and calibrated the models keeps its own, idle, for the life of the process, and the small matrices of a
speculative round pay those wake-ups in every layer (docs/results/2026-12-07-openmp-teams.md). `release_openmp_threads`,
called on the thread that did that work before it hands the models over, ends its team (OpenMP 5.0's
`omp_pause_resource_all`); the thread gets a new team if it runs a parallel region again.
"""

from __future__ import annotations

import ctypes
import functools

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the threads go, what they would need again may stay


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy, whatever its file name), or None (no libgomp: another
    OpenMP runtime, which keeps one pool for the process and needs no release, or another platform)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
            library.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return library
        except (OSError, AttributeError):  # not loadable, or a libgomp older than OpenMP 5.0's pause (GCC 9)
            continue
    return None


def release_openmp_threads() -> bool:
    """End the calling thread's OpenMP team (libgomp only), so that the thread that decodes next is the only team
    and libgomp keeps spinning at its barriers. Call it on the thread that loaded the models, once it stops running
    torch; never from inside a parallel region. True when a team was released (or there was none to release)."""
    import torch  # noqa: F401  (libgomp is loaded with torch)

    library = _libgomp()
    if library is None:
        return False
    return library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
