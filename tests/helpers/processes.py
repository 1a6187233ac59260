"""Running a test's workers as real processes (gloo groups on this machine), with a deadline."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

# fork reuses the imports already paid for (torch + torchmetrics take seconds per process);
# the parent never initialises a process group, so gloo starts clean in each child.
START_METHOD = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
DEADLINE_S = 120.0


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(worker: Any, out_dir: Path | str, processes: int) -> None:
    """Run ``worker(rank, port, out_dir)`` in ``processes`` processes; fail the test past the deadline."""
    context = mp.start_processes(
        worker, args=(free_port(), str(out_dir)), nprocs=processes, join=False, start_method=START_METHOD
    )
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(f"workers did not finish within {DEADLINE_S:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
