"""The CUDA path in one run: correctness against float64, then cost against the model's own SDPA call.

Self-contained (torch and this repository only) and meant to finish in a few
minutes on one large GPU. On a machine without CUDA it says so and exits 0.

1. Correctness: a bfloat16 "model" produces q and k; ``entropy_from_qk``
   computes in float32 on the GPU; the reference is dense float64 softmax
   entropy (query blocks, on the GPU) over the same bfloat16 values. Mask
   families as models pass them: causal flag, key padding (B, 1, 1, N) bool,
   dense causal+padding (bool and additive), sliding window, packed
   documents, grouped-query keys, and logits of ~1e3 (the float64 pass).
2. Cost: at N = 1k .. 16k, the entropy pass (``entropy_from_qk``, float32)
   against the model's own SDPA call (bfloat16, same mask), interleaved,
   CUDA-event timed, median [min-max] of the paired ratios; plus the peak
   extra memory of the entropy pass.

Prints markdown tables.

    python benchmarks/gpu.py [--sizes 1024 2048 4096 8192 16384] [--repeats 5]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attn_monitor import entropy_from_qk

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
WINDOW, DOCUMENTS = 1024, 4
#: Sequence length of the correctness checks (half of it for the large-logit ones).
CHECK_N = 2048


# ------------------------------------------------------------------ masks, as models pass them
def _padding(batch: int, n: int, device: torch.device) -> Tensor:
    lengths = torch.linspace(n // 2, n, batch, device=device).long()
    return torch.arange(n, device=device)[None, :] < lengths[:, None]


def _causal(n: int, device: torch.device) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def _additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)


def mask_for(family: str, batch: int, n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor | None, bool]:
    """(attn_mask, is_causal) of one family, in the model's dtype where additive."""
    if family == "causal":
        return None, True
    if family == "padding":
        return _padding(batch, n, device)[:, None, None, :], False
    if family == "causal+padding":
        return _causal(n, device) & _padding(batch, n, device)[:, None, None, :], False
    if family == "causal+padding additive":
        return _additive(_causal(n, device) & _padding(batch, n, device)[:, None, None, :], dtype), False
    rows = torch.arange(n, device=device)
    if family == "window":
        return (_causal(n, device) & (rows[None, :] > rows[:, None] - WINDOW))[None, None], False
    if family == "documents":
        ids = rows * DOCUMENTS // n
        return ((ids[:, None] == ids[None, :]) & _causal(n, device))[None, None], False
    raise KeyError(family)


def visible_of(mask: Tensor | None, is_causal: bool, n: int, device: torch.device) -> Tensor:
    visible = torch.ones(1, 1, n, n, dtype=torch.bool, device=device) if mask is None else mask
    if visible.dtype != torch.bool:
        visible = visible > torch.finfo(visible.dtype).min / 2
    return visible & _causal(n, device) if is_causal else visible


# ------------------------------------------------------------------ reference
def reference_entropy(q: Tensor, k: Tensor, visible: Tensor, block: int = 512) -> Tensor:
    """Dense float64 entropy per query, query blocks at a time; NaN where no key is visible."""
    q64, k64 = q.double(), k.double()
    if k64.shape[1] != q64.shape[1]:
        k64 = k64.repeat_interleave(q64.shape[1] // k64.shape[1], dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty(q.shape[:3], dtype=torch.float64, device=q.device)
    for start in range(0, q.shape[2], block):
        stop = min(q.shape[2], start + block)
        scores = (q64[:, :, start:stop] @ k64.transpose(-1, -2)) * scale
        seen = visible[..., start:stop, :]
        scores = scores.masked_fill(~seen, -math.inf)
        entropy = torch.special.entr(scores.softmax(-1)).sum(-1)
        out[:, :, start:stop] = entropy.masked_fill(~seen.any(-1), math.nan)
    return out


def model_qk(
    batch: int, n: int, kv_heads: int, device: torch.device, logit_scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    """q and k as a bfloat16 model hands them to SDPA (GQA: fewer key heads)."""
    generator = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, HEADS, n, HEAD_DIM, device=device, generator=generator) * logit_scale
    k = torch.randn(batch, kv_heads, n, HEAD_DIM, device=device, generator=generator)
    return q.to(torch.bfloat16), k.to(torch.bfloat16)


FAMILIES = ["causal", "padding", "causal+padding", "causal+padding additive", "window", "documents"]


def correctness(device: torch.device) -> str:
    lines = [
        "### Correctness: bfloat16 model, float32 entropy, against float64",
        "",
        "| mask | N | kv heads | logits | max abs error (nats) | queries |",
        "|---|---|---|---|---|---|",
    ]
    cases = [(family, CHECK_N, HEADS, 1.0) for family in FAMILIES]
    cases += [("causal+padding", CHECK_N, KV_HEADS, 1.0), ("padding", CHECK_N, KV_HEADS, 1.0)]
    cases += [("causal+padding", CHECK_N // 2, HEADS, 100.0), ("window", CHECK_N // 2, KV_HEADS, 100.0)]
    worst = 0.0
    for family, n, kv_heads, logit_scale in cases:
        batch = 2
        q, k = model_qk(batch, n, kv_heads, device, logit_scale)
        mask, is_causal = mask_for(family, batch, n, device, q.dtype)
        got = entropy_from_qk(q, k, mask=mask, is_causal=is_causal).double()
        want = reference_entropy(q, k, visible_of(mask, is_causal, n, device))
        if not torch.equal(torch.isnan(got), torch.isnan(want)):
            raise AssertionError(f"{family}: NaN pattern differs from the reference")
        error = float((got - want).abs().nan_to_num(0.0).max())
        worst = max(worst, error)
        size = float((q[:, :1].float() @ k[:, :1].float().transpose(-1, -2)).abs().max()) / math.sqrt(HEAD_DIM)
        lines.append(f"| {family} | {n} | {kv_heads} | ~{size:.0f} | {error:.1e} | {int((~torch.isnan(want)).sum())} |")
        print(lines[-1], flush=True)
    lines += ["", f"Largest error {worst:.1e} nats ({'PASS' if worst <= 1e-4 else 'FAIL'}: limit 1e-4)."]
    return "\n".join(lines)


# ------------------------------------------------------------------ cost
def cuda_time(fn: Callable[[], object]) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3


def measure(family: str, n: int, repeats: int, device: torch.device) -> str:
    """One table row: the model's SDPA call and the entropy pass on the same q, k and mask."""
    q, k = model_qk(1, n, KV_HEADS, device)
    v = torch.randn_like(k)
    mask, is_causal = mask_for(family, 1, n, device, q.dtype)
    group = HEADS // KV_HEADS
    k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def model_call() -> object:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask)

    def entropy_call() -> object:
        return entropy_from_qk(q, k, mask=mask, is_causal=is_causal)

    model_call(), entropy_call()  # warm-up
    torch.cuda.synchronize()
    base, ratios = [], []
    for _ in range(repeats):
        base.append(cuda_time(model_call))
        ratios.append(cuda_time(entropy_call) / base[-1])
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    entropy_call()
    extra = (torch.cuda.max_memory_allocated() - before) / 2**20
    return (
        f"| {family} | {n} | {statistics.median(base) * 1e3:.2f} | {statistics.median(ratios):.2f} "
        f"[{min(ratios):.2f}-{max(ratios):.2f}] | {extra:.0f} |"
    )


def cost(device: torch.device, sizes: list[int], repeats: int) -> str:
    lines = [
        f"### Cost: entropy pass vs the model's SDPA call (B=1, {HEADS} heads, {KV_HEADS} kv heads, D={HEAD_DIM})",
        "",
        f"Paired ratios entropy / SDPA over {repeats} interleaved repeats: median [min-max]. The model's call is",
        "bfloat16 SDPA with the same mask (GQA keys repeated when a mask is given, as Hugging Face does); the",
        "entropy pass is float32. extra MiB: peak memory of the entropy pass above its inputs.",
        "",
        "| mask | N | SDPA ms | entropy x | extra MiB |",
        "|---|---|---|---|---|",
    ]
    for family in ("causal", "causal+padding", "window"):
        for n in sizes:
            lines.append(measure(family, n, repeats, device))
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device here: benchmarks/gpu.py needs one GPU; nothing was measured.")
        return 0
    device = torch.device("cuda")
    started = time.perf_counter()
    print(f"## attn_monitor on {torch.cuda.get_device_name(device)}, torch {torch.__version__}\n", flush=True)
    print(correctness(device) + "\n", flush=True)
    print(cost(device, args.sizes, args.repeats), flush=True)
    print(f"\nTotal {time.perf_counter() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
