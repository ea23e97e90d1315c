"""Which machine this is, as results and cached measurements name it: the CPU's model name (costs differ by CPU, so a
T(M) table is cached per CPU and a benchmark says which one measured it)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what the platform module reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
