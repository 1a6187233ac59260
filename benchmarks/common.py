"""Pieces every benchmark shares: the machine's description and peak memory in a fresh child process."""

from __future__ import annotations

import multiprocessing
import os
import platform
import queue as queue_module
import resource
import time
from collections.abc import Callable, Sequence
from typing import Any

#: A child that sends nothing for this long is taken as hung.
CHILD_TIMEOUT_S = 900.0


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Restart this process's peak resident set from its current size (Linux; elsewhere nothing happens)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def _peak_bytes() -> int:
    """This process's peak resident set size (since the last reset, where there was one)."""
    try:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def put_peak_growth(queue: Any, run: Callable[[], Any]) -> None:
    """In a child: send the peak resident growth (bytes) of ``run()`` above the resident set before it.

    The peak is reset first, so building the inputs (which can briefly hold
    more than the call itself) does not count; where it cannot be reset the
    figure is an upper bound.
    """
    _reset_peak()
    start = rss_bytes()
    run()
    queue.put(max(0, _peak_bytes() - start))


def run_children(
    target: Callable[..., None], args_per_child: Sequence[tuple], count_results: int, preload: Sequence[str]
) -> list[Any]:
    """Start one child per args tuple (each gets the queue last); return ``count_results`` queued values.

    Children come from a fork server that has imported ``preload`` but never
    run an op: forking after OpenMP threads have started can deadlock, so
    plain fork is never used. The preload applies only if this process has
    not started its fork server yet.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    queue = context.Queue()
    children = [context.Process(target=target, args=(*args, queue)) for args in args_per_child]
    for child in children:
        child.start()
    results: list[Any] = []
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        while len(results) < count_results:
            try:
                results.append(queue.get(timeout=1.0))
            except queue_module.Empty:
                failed = [child.exitcode for child in children if child.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"A benchmark child failed (exit codes {failed}).") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"The benchmark children sent nothing within {CHILD_TIMEOUT_S:.0f} s.") from None
    finally:
        for child in children:
            child.join(timeout=30)
            if child.is_alive():
                child.terminate()
                child.join()
    return results
