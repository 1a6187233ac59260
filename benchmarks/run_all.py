"""Run every benchmark and write benchmarks/REPORT.md (``make bench``).

Sections, in order (each one's failure is reported and the rest still run):

* ``bench_entropy``: the entropy kernel per mask family at N = 128 .. 4096,
  paired ratios to the model's own SDPA call. The dense path materialises
  (B, H, N, N) float32 tensors, several at once; where that would need more
  than ``--dense-limit-gib`` (default 2 GiB: N <= 2048) it is left out ("—").
* ``bench_capture`` (when ``benchmarks/bench_capture.py`` exists): capture
  cost in real models.
* ``bench_stats``: per-head max logit and attention distance, as multiples
  of one SDPA forward.
* ``bench_flex``: a FlexAttention forward recorded vs not, per ``score_mod``.
* ``bench_monitor``: the Lightning callback's cost and the metric's DDP sync.

    .venv/bin/python benchmarks/run_all.py            # full run, writes benchmarks/REPORT.md
    .venv/bin/python benchmarks/run_all.py --quick    # smoke run: small sizes, 1 repeat, report in the temp dir
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from common import cpu_model

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

FULL_ENTROPY_SIZES = [128, 512, 1024, 2048, 4096]
QUICK_ENTROPY_SIZES = [128, 256]


# ------------------------------------------------------------------ entropy
def run_entropy(sizes: list[int], repeats: int, dense_limit_gib: float) -> str:
    import bench_entropy

    argv = ["--sizes", *map(str, sizes), "--repeats", str(repeats), "--dense-limit-gib", str(dense_limit_gib)]
    return str(bench_entropy.main(argv))


# ------------------------------------------------------------------ report
def _read(path: str, prefix: str) -> str | None:
    try:
        with open(path) as source:
            return next((line.split(":", 1)[1].strip() for line in source if line.startswith(prefix)), None)
    except OSError:
        return None


def _git_revision() -> str:
    try:
        revision = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return revision + (" (uncommitted changes)" if dirty else "")


def machine_lines(threads: int, monitor_threads: int) -> list[str]:
    cpu = cpu_model()
    memory = _read("/proc/meminfo", "MemTotal")
    memory_gib = f"{int(memory.split()[0]) / 2**20:.0f} GiB RAM" if memory else "RAM unknown"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        load = f"{os.getloadavg()[0]:.1f}"
    except OSError:
        load = "unknown"
    import lightning

    return [
        f"- Machine: {cpu}, {os.cpu_count()} logical CPUs ({usable} usable), {memory_gib}, {platform.system()} "
        f"{platform.release()}",
        f"- Software: Python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}",
        f"- Torch threads: {threads} for bench_entropy and bench_capture (torch's default here is "
        f"{torch.get_num_threads()}), {monitor_threads} for bench_monitor; memory children run torch's default.",
        f"- Load average (1 min) at start: {load}. The CPUs are shared: compare ratios measured side by side "
        "in one run, not absolute times across runs.",
        f"- Revision: {_git_revision()}",
    ]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small sizes, 1 repeat")
    parser.add_argument("--out", default=None, help="report path (default benchmarks/REPORT.md; --quick: temp dir)")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch threads for entropy/capture"
    )
    parser.add_argument("--monitor-threads", type=int, default=1, help="torch threads for bench_monitor (default 1)")
    parser.add_argument(
        "--dense-limit-gib", type=float, default=2.0, help="skip the dense entropy path above this estimate"
    )
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) if args.quick else HERE)
    if not args.out:
        out = out / ("attn_monitor-REPORT-quick.md" if args.quick else "REPORT.md")
    torch.set_num_threads(args.threads)

    repeats = ["--repeats", "1"] if args.quick else []
    capture_argv = ["--threads", str(args.threads), *repeats] + (["--sizes", "256"] if args.quick else [])
    monitor_argv = ["--threads", str(args.monitor_threads), *repeats]
    if args.quick:
        monitor_argv += ["--val-batches", "4", "--train-steps", "10", "--sync-layers", "4", "32", "--sync-repeats", "2"]
    entropy_sizes = QUICK_ENTROPY_SIZES if args.quick else FULL_ENTROPY_SIZES
    entropy_repeats = 1 if args.quick else 9

    def capture() -> str:
        return str(importlib.import_module("bench_capture").main(capture_argv))

    stats_sizes = ["256", "512"] if args.quick else ["512", "1024", "2048"]
    stats_argv = ["--threads", str(args.threads), *repeats, "--sizes", *stats_sizes]

    def stats() -> str:
        return str(importlib.import_module("bench_stats").main(stats_argv))

    flex_argv = ["--sizes", "256"] if args.quick else ["--sizes", "512", "1024"]
    flex_argv += repeats

    def flex() -> str:
        return str(importlib.import_module("bench_flex").main(flex_argv))

    def monitor() -> str:
        return str(importlib.import_module("bench_monitor").main(monitor_argv))

    sections: list[tuple[str, str, Callable[[], str]]] = [
        (
            "Entropy kernel",
            f"benchmarks/bench_entropy.py --sizes {' '.join(map(str, entropy_sizes))} --repeats {entropy_repeats}"
            f" (dense path skipped above an estimated {args.dense_limit_gib:g} GiB)",
            lambda: run_entropy(entropy_sizes, entropy_repeats, args.dense_limit_gib),
        ),
    ]
    if (HERE / "bench_capture.py").exists():
        sections.append(("Capture in real models", f"benchmarks/bench_capture.py {' '.join(capture_argv)}", capture))
    sections.append(("Max logit and distance", f"benchmarks/bench_stats.py {' '.join(stats_argv)}", stats))
    sections.append(("FlexAttention", f"benchmarks/bench_flex.py {' '.join(flex_argv)}", flex))
    sections.append(("Monitor in Lightning", f"benchmarks/bench_monitor.py {' '.join(monitor_argv)}", monitor))

    header = machine_lines(args.threads, args.monitor_threads)
    started = datetime.datetime.now(datetime.timezone.utc)
    start = time.perf_counter()
    bodies, runtimes, failures = [], [], []
    for title, command, run in sections:
        print(f"\n=== {title}: {command}", flush=True)
        section_start = time.perf_counter()
        try:
            body = run()
        except Exception:  # report it, run the rest
            failures.append(title)
            body = "FAILED:\n\n```\n" + traceback.format_exc() + "```"
            print(body, file=sys.stderr, flush=True)
        elapsed = time.perf_counter() - section_start
        runtimes.append(f"{title} {elapsed / 60:.1f} min")
        bodies.append(f"## {title}\n\n`{command}` ({elapsed / 60:.1f} min)\n\n{body}")
    total = time.perf_counter() - start

    command = ".venv/bin/python benchmarks/run_all.py" + (" --quick" if args.quick else "")
    if argv is None and sys.argv[1:]:
        command = ".venv/bin/python benchmarks/run_all.py " + " ".join(sys.argv[1:])
    report = "\n".join(
        [
            "# attn_monitor benchmarks" + (" (quick smoke run: not for comparison)" if args.quick else ""),
            "",
            f"- Date: {started:%Y-%m-%d %H:%M} UTC; total {total / 60:.1f} min ({', '.join(runtimes)})",
            *header,
            f"- Reproduce: `{command}`" + ("" if args.quick else " (or `make bench`)"),
            "",
            "\n\n".join(bodies),
            "",
        ]
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(f"\nWrote {out} ({total / 60:.1f} min).")
    if failures:
        print(f"Failed sections: {', '.join(failures)}", file=sys.stderr)
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    main()
