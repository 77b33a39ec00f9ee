"""What a task's process uses, for its gauges: resident memory, a thread's CPU seconds."""

from __future__ import annotations

import os
import threading
import time

__all__ = ["rss_bytes", "thread_cpu_seconds"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident memory of this process in bytes (0 if it cannot be read)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        try:
            import resource

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        except Exception:
            return 0


def thread_cpu_seconds(thread: threading.Thread | None) -> float | None:
    """CPU seconds a running thread used (Linux), or None."""
    if thread is None or thread.ident is None or not thread.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError):
        return None
