"""Cost of the fast path's self-check and of the max-logit bound, as a fraction of a monitored validation.

A validation is what :class:`~attn_monitor.MonitorCore` does in a plain loop:
``--batches`` recorded forward passes of a causal SDPA decoder (the mask is
causal order and the batch's right padding, as a language model passes it)
and ``validation_end`` (compute, no sinks). Three monitors, each a fresh
core per repeat (the self-check runs on a run's first recorded batch):

* **base**: ``Statistics(self_check=None)``;
* **self-check**: ``Statistics()`` (the default: one sampled block of 32
  queries per layer recomputed densely in float64 on the first batch);
* **bound**: ``Statistics(self_check=None, max_logit_bound=True)`` (the
  bracket from the entropy pass's own logsumexp and entropy).

Two sizes: the demo's (2 layers x 4 heads, d=64, batch 64, sequence 30) and
a larger one (4 layers x 8 heads, d=256, batch 8, sequence 512). Repeats are
interleaved (the order rotates every repeat); the extra cost is the median
[inter-quartile range] of per-repeat paired differences over the base, as a
fraction of the base validation. Whole validations are noisy next to a
cost this small, so the check is also timed alone: on one layer's call, the
fast pass (``attention_lse_entropy``) against the check of its sampled block
(``FastPathCheck._agrees``: the dense float64 recomputation and the
comparison), interleaved; the check's share of a validation is then
``layers x check ms / base validation ms``. Torch runs ``--threads`` threads.

    python benchmarks/bench_signals.py [--repeats 7] [--threads 1] [--batches 4]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cpu_model

from attn_monitor import Batches, MonitorCore, SelfCheck, Statistics
from attn_monitor.capture.calls import AttentionCall
from attn_monitor.capture.selfcheck import FastPathCheck
from attn_monitor.functional.entropy import attention_lse_entropy
from attn_monitor.functional.masks import Support

#: (name, layers, heads, d_model, batch, sequence)
SIZES = [("demo", 2, 4, 64, 64, 30), ("larger", 4, 8, 256, 8, 512)]
VOCAB = 128


class Block(nn.Module):
    """Pre-LN block: causal SDPA with the batch's padding, then an MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, width))
        return x + self.mlp(self.ln_2(x))


class Decoder(nn.Module):
    def __init__(self, layers: int, heads: int, d_model: int, seq: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, d_model), nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        seq = input_ids.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        x = self.embed(input_ids) + self.position(torch.arange(seq))
        for block in self.blocks:
            x = block(x, mask)
        return x


def make_batches(count: int, batch: int, seq: int) -> list[dict[str, Tensor]]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=generator)
        lengths[0] = seq
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        out.append({"input_ids": torch.randint(1, VOCAB, (batch, seq), generator=generator), "attention_mask": mask})
    return out


MONITORS = {
    "base": lambda: Statistics(self_check=None),
    "self-check": lambda: Statistics(),
    "bound": lambda: Statistics(self_check=None, max_logit_bound=True),
}


def validation_ms(model: nn.Module, batches: list[dict[str, Tensor]], statistics_options: Statistics) -> float:
    """One monitored validation (fresh core: a new run) of every batch, in milliseconds."""
    core = MonitorCore(batches=Batches(len(batches)), statistics=statistics_options)
    core.attach(model)
    start = time.perf_counter()
    with torch.no_grad():
        assert core.validation_start()
        for index, batch in enumerate(batches):
            with core.recording(index, batch):
                model(**batch)
        core.validation_end(0)
    elapsed = (time.perf_counter() - start) * 1e3
    core.release()
    return elapsed


def _spread(values: list[float], digits: int = 3) -> str:
    median = statistics.median(values)
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return f"{median:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def check_alone(layers: int, heads: int, d_model: int, batch: int, seq: int, repeats: int) -> tuple[float, float]:
    """(fast pass ms, check ms) on one layer's call, medians of interleaved repeats."""
    generator = torch.Generator().manual_seed(1)
    q, k = (torch.randn(batch, heads, seq, d_model // heads, generator=generator) for _ in range(2))
    padding = make_batches(1, batch, seq)[0]["attention_mask"].bool()
    call = AttentionCall("layer", Support(seq, seq, padding_mask=padding, causal=True), q=q, k=k)
    sample = call.support.is_sample()
    lse, entropy = attention_lse_entropy(q, k, mask=call.support)
    check = FastPathCheck(SelfCheck())
    fast, checked = [], []
    for _ in range(repeats * 5):
        start = time.perf_counter()
        attention_lse_entropy(q, k, mask=call.support)
        fast.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        assert check._agrees(call, lse, entropy, sample, "auto")
        checked.append((time.perf_counter() - start) * 1e3)
    return statistics.median(fast), statistics.median(checked)


def bench(repeats: int, batches: int) -> str:
    lines = [
        "| model | monitor | validation ms | extra ms | extra / base validation |",
        "|---|---|---|---|---|",
    ]
    alone = [
        "| model | fast pass ms (one layer, one batch) | check ms (one layer) | check / fast pass | "
        "check share of a base validation |",
        "|---|---|---|---|---|",
    ]
    for name, layers, heads, d_model, batch, seq in SIZES:
        torch.manual_seed(0)
        model = Decoder(layers, heads, d_model, seq).eval()
        data = make_batches(batches, batch, seq)
        times: dict[str, list[float]] = {monitor: [] for monitor in MONITORS}
        for options in MONITORS.values():  # warm-up: first calls, lazy imports
            validation_ms(model, data, options())
        order = list(MONITORS)
        for repeat in range(repeats):
            for monitor in order[repeat % len(order) :] + order[: repeat % len(order)]:
                times[monitor].append(validation_ms(model, data, MONITORS[monitor]()))
        base = times["base"]
        for monitor, values in times.items():
            extra = [value - b for value, b in zip(values, base, strict=True)]
            fraction = [value / b - 1.0 for value, b in zip(values, base, strict=True)]
            shown = "—" if monitor == "base" else _spread(extra, 1)
            share = "—" if monitor == "base" else _spread(fraction)
            lines.append(
                f"| {name}: {layers} x {heads}, d={d_model}, {batch} x {seq} | {monitor} | "
                f"{statistics.median(values):.1f} | {shown} | {share} |"
            )
        fast, check = check_alone(layers, heads, d_model, batch, seq, repeats)
        alone.append(
            f"| {name} | {fast:.3f} | {check:.3f} | {check / fast:.3f} | "
            f"{layers * check / statistics.median(base):.4f} |"
        )
    return "\n".join(lines) + "\n\nThe check alone:\n\n" + "\n".join(alone)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    table = bench(args.repeats, args.batches)
    header = (
        f"### Self-check and max-logit bound: cost per monitored validation\n\n"
        f"{cpu_model()}, torch {torch.__version__}, {args.threads} torch thread(s); {args.batches} recorded "
        f"batches per validation, {args.repeats} interleaved repeats, a fresh MonitorCore per validation. "
        f"extra: median [inter-quartile range] of paired differences with the base run of the same repeat.\n"
    )
    text = f"{header}\n{table}\n\nTotal {math.ceil(time.perf_counter() - started)} s."
    print(text)
    return text


if __name__ == "__main__":
    main()
