"""Cost of the per-head statistics: max logit and attention distance vs one plain SDPA forward.

Same inputs as ``bench_entropy`` (B=4, H=8, D=64, random q and k; the
mask families as models pass them: a causal flag, and a causal + padding
dense mask). Times are medians of interleaved repeats in one process,
reported as ratios to a plain SDPA forward on the same inputs; entropy
(``method="auto"``) is timed alongside for comparison.

    python benchmarks/bench_stats.py [--sizes 512 1024 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from bench_entropy import BATCH, HEAD_DIM, HEADS, make_inputs, plain_sdpa
from common import cpu_model

from attn_monitor import attention_distance, attention_max_logit, entropy_from_qk

Path = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", bool], torch.Tensor]
PATHS: dict[str, Path] = {
    "sdpa": plain_sdpa,
    "entropy": lambda q, k, m, c: entropy_from_qk(q, k, mask=m, is_causal=c),
    "max_logit": lambda q, k, m, c: attention_max_logit(q, k, mask=m, is_causal=c),
    "distance": lambda q, k, m, c: attention_distance(q, k, mask=m, is_causal=c),
}


def time_paths(n: int, mask_kind: str, repeats: int) -> dict[str, float]:
    """Median seconds of each path at sequence length ``n``."""
    q, k, mask, is_causal = make_inputs(n, mask_kind)
    samples: dict[str, list[float]] = {name: [] for name in PATHS}
    for fn in PATHS.values():  # warm-up
        fn(q, k, mask, is_causal)
    for _ in range(repeats):
        for name, fn in PATHS.items():
            start = time.perf_counter()
            fn(q, k, mask, is_causal)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def report(sizes: list[int], repeats: int) -> str:
    lines = [
        f"B={BATCH}, H={HEADS}, D={HEAD_DIM}, float32 on CPU ({cpu_model()}, {torch.get_num_threads()} threads); "
        f"median of {repeats} interleaved repeats; cost as a multiple of one plain SDPA forward.",
        "",
        "| mask | N | SDPA (ms) | entropy / SDPA | max logit / SDPA | distance / SDPA |",
        "|---|---|---|---|---|---|",
    ]
    for mask_kind in ("causal", "causal+padding"):
        for n in sizes:
            times = time_paths(n, mask_kind, repeats)
            base = times["sdpa"]
            row = (
                f"| {mask_kind} | {n} | {base * 1e3:.1f} | {times['entropy'] / base:.2f} "
                f"| {times['max_logit'] / base:.2f} | {times['distance'] / base:.2f} |"
            )
            print(row, flush=True)
            lines.append(row)
    lines += [
        "",
        "Max logit scans every visible block of scores (no fused kernel returns it on CPU). Distance takes one "
        "fused SDPA call with V = key positions where every visible key precedes its query and logits are "
        "bounded (causal order and key padding); other supports are scored block by block.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    table = report(args.sizes, args.repeats)
    print(table)
    return table


if __name__ == "__main__":
    main()
