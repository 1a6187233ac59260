"""FlexAttention path: what monitoring a flex_attention call costs, and how exact it is.

One attention module calling ``flex_attention`` (packed documents, causal,
as a ``BlockMask``), with no ``score_mod``, an ALiBi-like one and a tanh
soft-cap. Times are medians of interleaved repeats in one process: the
module's plain forward, and the same forward while a capture records it
(reading the call, building the support from the block mask, computing the
entropy). The error is the largest |monitored - float64 dense| per-query
entropy in nats.

    python benchmarks/bench_flex.py [--sizes 256 512 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from common import cpu_model
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from attn_monitor import AttentionCapture, entropy_from_qk
from attn_monitor.functional.flex import read_flex_call

BATCH, HEADS, HEAD_DIM, DOCUMENTS = 2, 8, 64, 4
SLOPES = 2.0 ** -torch.arange(1, HEADS + 1, dtype=torch.float32)


def _alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def _softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


SCORE_MODS: dict[str, Callable | None] = {"none": None, "alibi": _alibi, "softcap": _softcap}


class FlexLayer(nn.Module):
    def __init__(self, block_mask: object, score_mod: Callable | None) -> None:
        super().__init__()
        self.block_mask, self.score_mod = block_mask, score_mod

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return flex_attention(q, k, k, score_mod=self.score_mod, block_mask=self.block_mask)


def make_inputs(n: int) -> tuple[torch.Tensor, torch.Tensor, object]:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=generator)
    k = torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=generator)
    documents = (torch.arange(n) * DOCUMENTS // n)[None, :].expand(BATCH, n)

    def packed(b, h, q_idx, kv_idx):
        return (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)

    return q, k, create_block_mask(packed, BATCH, None, n, n, device="cpu")


def time_row(n: int, name: str, repeats: int) -> tuple[float, float]:
    """(plain forward s, recorded forward s)."""
    q, k, block_mask = make_inputs(n)
    layer = FlexLayer(block_mask, SCORE_MODS[name])
    with AttentionCapture(layer) as capture:

        def recorded() -> None:
            with capture.recording():
                layer(q, k)

        paths = {"plain": lambda: layer(q, k), "recorded": recorded}
        samples: dict[str, list[float]] = {key: [] for key in paths}
        for fn in paths.values():  # warm-up
            fn()
        for _ in range(repeats):
            for key, fn in paths.items():
                start = time.perf_counter()
                fn()
                samples[key].append(time.perf_counter() - start)
    return statistics.median(samples["plain"]), statistics.median(samples["recorded"])


def max_error(n: int, name: str) -> float:
    q, k, block_mask = make_inputs(n)
    score_mod = SCORE_MODS[name]
    seen: list[tuple] = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", None) == "flex_attention":
                seen.append(args)
            return func(*args, **(kwargs or {}))

    with Spy():
        flex_attention(q, k, k, score_mod=score_mod, block_mask=block_mask)
    q32, k32, scale, support, mod = read_flex_call(seen[0], {})
    entropy = entropy_from_qk(q32, k32, mask=support, scale=scale, score_mod=mod)
    # float64 dense reference, written out apart from the library.
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    rows, cols = torch.arange(n, dtype=torch.float64)[:, None], torch.arange(n, dtype=torch.float64)[None, :]
    if name == "alibi":
        scores = scores + SLOPES.double()[None, :, None, None] * (cols - rows)
    elif name == "softcap":
        scores = 20.0 * torch.tanh(scores / 20.0)
    documents = torch.arange(n) * DOCUMENTS // n
    visible = (documents[:, None] == documents[None, :]) & (cols <= rows)
    probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
    reference = -torch.special.xlogy(probs, probs).sum(-1)
    return float((entropy.double() - reference).abs().max())


def report(sizes: list[int], repeats: int) -> str:
    lines = [
        f"FlexAttention path, B={BATCH}, H={HEADS}, D={HEAD_DIM}, {DOCUMENTS} packed causal documents, float32, "
        f"eager flex on CPU ({cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}).",
        "",
        "| score_mod | N | flex forward ms | recorded x | max err (nats) |",
        "|---|---|---|---|---|",
    ]
    for name in SCORE_MODS:
        for n in sizes:
            plain, recorded = time_row(n, name, repeats)
            lines.append(
                f"| {name} | {n} | {plain * 1e3:.1f} | {recorded / plain:.2f} | {max_error(min(n, 512), name):.1e} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*flex_attention.*", category=UserWarning)
    table = report(args.sizes, args.repeats)
    print(table)
    return table


if __name__ == "__main__":
    main()
