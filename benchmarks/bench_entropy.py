"""Entropy kernel cost per mask family: ``entropy_from_qk`` vs the model's own SDPA call.

Each mask family is given to both exactly as models pass it to
``F.scaled_dot_product_attention`` (a causal flag, a (B, 1, 1, N) key-padding
mask, a dense (B, 1, N, N) causal+padding mask in bool or additive form, a
dense sliding window, dense block-diagonal packed documents). Times are
interleaved: every repeat runs SDPA and then each path on the same inputs,
and the table gives the median over repeats of the paired ratio path / SDPA
with its range [min-max], so load shared with other processes cancels out
as far as it can. Peak memory is the resident-set growth of one call in a
fresh child process. The error columns compare with a float64 dense
reference: at ordinary logits, and at logits of ~1e4 (the collapse regime).

    python benchmarks/bench_entropy.py [--sizes 128 512 1024 2048] [--repeats 9] [--families causal padding]
"""

from __future__ import annotations

import argparse
import functools
import math
import multiprocessing
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import cpu_model, put_peak_growth, run_children
from torch import Tensor

from attn_monitor import entropy_from_qk

BATCH, HEADS, HEAD_DIM = 4, 8, 64
#: The dense path holds this many (B, H, N, N) float32 tensors at its peak.
DENSE_LIVE_TENSORS = 3
#: Sliding window width (tokens) and number of packed documents per row.
WINDOW, DOCUMENTS = 256, 4

#: family -> (attn_mask or None, is_causal) as a model passes them to SDPA, for sequence length n.
Family = Callable[[int], tuple[Tensor | None, bool]]


def _lengths(n: int) -> Tensor:
    """Real tokens per row: from n/2 to n (right padding)."""
    return torch.linspace(n // 2, n, BATCH).long()


def _padding(n: int) -> Tensor:
    return torch.arange(n)[None, :] < _lengths(n)[:, None]


def _causal(n: int) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def _additive(visible: Tensor) -> Tensor:
    return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)


def _window(n: int) -> Tensor:
    rows = torch.arange(n)
    return _causal(n) & (rows[None, :] > rows[:, None] - WINDOW)


def _documents(n: int) -> Tensor:
    ids = torch.arange(n) * DOCUMENTS // n
    return (ids[:, None] == ids[None, :]) & _causal(n)


FAMILIES: dict[str, Family] = {
    "causal": lambda n: (None, True),
    "padding": lambda n: (_padding(n)[:, None, None, :], False),
    "causal+padding": lambda n: (_causal(n) & _padding(n)[:, None, None, :], False),
    "causal+padding additive": lambda n: (_additive(_causal(n) & _padding(n)[:, None, None, :]), False),
    "window": lambda n: (_window(n)[None, None], False),
    "documents": lambda n: (_documents(n)[None, None], False),
}


def make_inputs(
    n: int, family: str, seed: int = 0, logit_scale: float = 1.0
) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=generator) * logit_scale
    k = torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=generator)
    return q, k, *FAMILIES[family](n)


def plain_sdpa(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    return F.scaled_dot_product_attention(q, k, k, attn_mask=mask, is_causal=is_causal)


def _visible(mask: Tensor | None, is_causal: bool, n: int) -> Tensor:
    visible = torch.ones(1, 1, n, n, dtype=torch.bool) if mask is None else mask
    if visible.dtype != torch.bool:
        visible = visible > torch.finfo(visible.dtype).min / 2
    return visible & _causal(n) if is_causal else visible


def dense_entropy(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """What a user of ``output_attentions`` does: materialise probabilities, sum p ln p."""
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~_visible(mask, is_causal, q.shape[2]), -math.inf)
    probs = scores.softmax(-1)
    return -torch.special.xlogy(probs, probs).sum(-1)


PATHS: dict[str, Callable[[Tensor, Tensor, Tensor | None, bool], Tensor]] = {
    "sdpa": plain_sdpa,
    "fused": lambda q, k, m, c: entropy_from_qk(q, k, mask=m, is_causal=c, method="fused"),
    "chunked": lambda q, k, m, c: entropy_from_qk(q, k, mask=m, is_causal=c, method="chunked"),
    "dense": dense_entropy,
}


def dense_bytes(n: int) -> int:
    """Estimated peak bytes of the dense path at sequence length ``n``."""
    return DENSE_LIVE_TENSORS * BATCH * HEADS * n * n * 4


def _peak_child(path: str, n: int, family: str, queue: multiprocessing.Queue) -> None:
    q, k, mask, is_causal = make_inputs(n, family)
    put_peak_growth(queue, lambda: PATHS[path](q, k, mask, is_causal))


def peak_memory(path: str, n: int, family: str) -> int:
    """Resident-set growth (bytes) of one call in a fresh child process."""
    (value,) = run_children(_peak_child, [(path, n, family)], 1, preload=["torch", "attn_monitor"])
    return int(value)


def time_paths(n: int, family: str, repeats: int, paths: list[str]) -> tuple[float, dict[str, list[float]]]:
    """(median SDPA seconds, paired ratios path / SDPA per repeat) with the paths interleaved.

    A repeat times each path over enough back-to-back calls to last ~20 ms,
    so that a 1 ms call is not measured against the timer's and the
    scheduler's jitter.
    """
    q, k, mask, is_causal = make_inputs(n, family)
    for name in ["sdpa", *paths]:  # warm-up
        PATHS[name](q, k, mask, is_causal)
    start = time.perf_counter()
    plain_sdpa(q, k, mask, is_causal)
    calls = max(1, math.ceil(0.02 / (time.perf_counter() - start)))

    def seconds(path: Callable[..., object]) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            path(q, k, mask, is_causal)
        return (time.perf_counter() - start) / calls

    base: list[float] = []
    ratios: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        base.append(seconds(plain_sdpa))
        for name in paths:
            ratios[name].append(seconds(PATHS[name]) / base[-1])
    return statistics.median(base), ratios


@functools.cache
def accuracy(n: int, family: str, logit_scale: float = 1.0) -> float:
    """Largest |fused - float64 dense| entropy over queries with a visible key, in nats."""
    q, k, mask, is_causal = make_inputs(n, family, logit_scale=logit_scale)
    reference = dense_entropy(q.double(), k.double(), mask, is_causal)
    fused = entropy_from_qk(q, k, mask=mask, is_causal=is_causal, method="fused").double()
    valid = ~torch.isnan(fused)
    return float((fused[valid] - reference[valid]).abs().max())


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def machine() -> str:
    return f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def report(sizes: list[int], repeats: int, families: list[str], dense_limit: float, memory: bool = True) -> str:
    lines = [
        f"Entropy kernel, B={BATCH}, H={HEADS}, D={HEAD_DIM}, float32 ({machine()}); window {WINDOW} tokens, "
        f"{DOCUMENTS} documents per row.",
        f"Ratios to the model's own SDPA call with the same mask: median [min-max] of {repeats} interleaved pairs.",
        "fused MiB: peak resident growth of one call in a fresh child. err: max |fused - float64| in nats, at",
        "ordinary logits and with q scaled so logits reach ~1e4 (N <= 1024). dense: materialised probabilities "
        "(— where it would need more memory than the limit).",
        "",
        "| mask | N | SDPA ms | fused x | chunked x | dense x | fused MiB | err | err, logits ~1e4 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for family in families:
        for n in sizes:
            paths = ["fused", "chunked"] + (["dense"] if dense_bytes(n) <= dense_limit else [])
            base, ratios = time_paths(n, family, repeats, paths)
            fused_mib = f"{peak_memory('fused', n, family) / 2**20:.0f}" if memory else "—"
            dense = _cell(ratios["dense"]) if "dense" in ratios else "—"
            small = min(n, 1024)
            row = (
                f"| {family} | {n} | {base * 1e3:.1f} | {_cell(ratios['fused'])} | {_cell(ratios['chunked'])} | "
                f"{dense} | {fused_mib} | {accuracy(small, family):.1e} | {accuracy(small, family, 3000.0):.1e} |"
            )
            print(row, flush=True)
            lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--dense-limit-gib", type=float, default=2.0, help="skip the dense path above this estimate")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    table = report(args.sizes, args.repeats, args.families, args.dense_limit_gib * 2**30, not args.no_memory)
    print(table)
    return table


if __name__ == "__main__":
    main()
