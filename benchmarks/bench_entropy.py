"""Entropy kernel cost: fused and chunked ``entropy_from_qk`` vs plain SDPA vs the dense path.

Times are medians of interleaved repeats in one process, reported as ratios
to a plain SDPA forward on the same inputs. Peak memory is measured in a
child process per configuration (resident-set growth above the child's start),
so one path's allocations never hide another's.

    python benchmarks/bench_entropy.py [--sizes 512 1024 2048 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import cpu_model, put_peak_growth, run_children

from attn_monitor import Support, entropy_from_qk

BATCH, HEADS, HEAD_DIM = 4, 8, 64


def make_inputs(n: int, mask_kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, Support]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=generator)
    k = torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=generator)
    if mask_kind == "causal":
        return q, k, Support(n, causal=True)
    lengths = torch.linspace(n // 2, n, BATCH).long()
    padding = torch.arange(n)[None, :] < lengths[:, None]
    return q, k, Support(n, padding_mask=padding)


def plain_sdpa(q: torch.Tensor, k: torch.Tensor, support: Support) -> torch.Tensor:
    attn_mask, is_causal = support.additive_mask(q.dtype)
    return F.scaled_dot_product_attention(q, k, k, attn_mask=attn_mask, is_causal=is_causal)


def dense_entropy(q: torch.Tensor, k: torch.Tensor, support: Support) -> torch.Tensor:
    """What a user of ``output_attentions`` does: materialise probabilities, sum p ln p."""
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~support.dense(), -math.inf)
    probs = scores.softmax(-1)
    return -torch.special.xlogy(probs, probs).sum(-1)


PATHS: dict[str, Callable[[torch.Tensor, torch.Tensor, Support], torch.Tensor]] = {
    "sdpa": plain_sdpa,
    "fused": lambda q, k, s: entropy_from_qk(q, k, mask=s, method="fused"),
    "chunked": lambda q, k, s: entropy_from_qk(q, k, mask=s, method="chunked"),
    "dense": dense_entropy,
}


def _peak_child(path: str, n: int, mask_kind: str, queue: multiprocessing.Queue) -> None:
    q, k, support = make_inputs(n, mask_kind)
    put_peak_growth(queue, lambda: PATHS[path](q, k, support))


def peak_memory(path: str, n: int, mask_kind: str) -> int:
    """Resident-set growth (bytes) of one call in a fresh child process."""
    (value,) = run_children(_peak_child, [(path, n, mask_kind)], 1, preload=["torch", "attn_monitor"])
    return int(value)


def time_paths(n: int, mask_kind: str, repeats: int) -> dict[str, float]:
    q, k, support = make_inputs(n, mask_kind)
    samples: dict[str, list[float]] = {name: [] for name in PATHS}
    for fn in PATHS.values():  # warm-up
        fn(q, k, support)
    for _ in range(repeats):
        for name, fn in PATHS.items():
            start = time.perf_counter()
            fn(q, k, support)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def accuracy(n: int, mask_kind: str) -> float:
    """Largest |fused - float64 dense| entropy, in nats."""
    q, k, support = make_inputs(n, mask_kind)
    reference = dense_entropy(q.double(), k.double(), support)
    fused = entropy_from_qk(q, k, mask=support, method="fused").double()
    valid = ~torch.isnan(fused)
    return float((fused[valid] - reference[valid]).abs().max())


def machine() -> str:
    return f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def report(sizes: list[int], repeats: int) -> str:
    lines = [
        f"Entropy kernel, B={BATCH}, H={HEADS}, D={HEAD_DIM}, float32 ({machine()}).",
        "Time ratios are to a plain SDPA forward on the same inputs (median of interleaved repeats);",
        "memory is peak resident growth of one call.",
        "",
        "| mask | N | SDPA ms | fused x | chunked x | dense x | dense / fused | fused MiB | chunked MiB "
        "| dense MiB | max err (nats) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mask_kind in ("causal", "padded"):
        for n in sizes:
            times = time_paths(n, mask_kind, repeats)
            memory = {name: peak_memory(name, n, mask_kind) / 2**20 for name in ("fused", "chunked", "dense")}
            base = times["sdpa"]
            lines.append(
                f"| {mask_kind} | {n} | {base * 1e3:.1f} | {times['fused'] / base:.2f} | "
                f"{times['chunked'] / base:.2f} | {times['dense'] / base:.1f} | "
                f"{times['dense'] / times['fused']:.1f} | {memory['fused']:.0f} | {memory['chunked']:.0f} | "
                f"{memory['dense']:.0f} | {accuracy(min(n, 1024), mask_kind):.1e} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    table = report(args.sizes, args.repeats)
    print(table)
    return table


if __name__ == "__main__":
    main()
