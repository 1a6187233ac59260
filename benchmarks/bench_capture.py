"""Capture cost in real models: one forward pass, unmonitored vs monitored vs ``output_attentions``.

Two small causal language models, batch 2 with right padding (the second row
is shorter), eval mode, no gradients, float32 on CPU:

* ``llama``: a Hugging Face Llama (4 layers, hidden 256, 8 heads, 4 kv heads,
  intermediate 512, vocab 1000) built from its config with random weights;
* ``nanogpt``: a nanoGPT-style model written here (4 layers, hidden 256, 8
  heads) calling ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``.

Paths, each one forward pass:

* **unmonitored**: the ``sdpa`` forward;
* **idle**: the same with an :class:`~attn_monitor.AttentionCapture` attached
  but not recording (hooks only);
* **monitored**: attached and recording (``capture.recording(padding_mask=...)``),
  entropy from the fused q/k kernel;
* **output_attentions**: what a user does today: the ``eager`` forward with
  ``output_attentions=True`` (nanoGPT: a manual eager path, ``softmax(q k^T *
  scale + causal mask) @ v``, keeping the probabilities), then dense entropy
  ``-sum p ln p`` over the padding support and per-layer means.

Times are medians of interleaved repeats in one process; ratios are to the
unmonitored forward. Above N = 1024 the output_attentions path, which
dominates the run time, joins only the first ``--eager-repeats`` rounds
(default 1); a verification pass over every path runs first and doubles as
warm-up. Peak memory is the resident-set growth of one forward in
a fresh child process per (model, N, path), so one path's allocations never
hide another's. Each configuration also checks that the monitored per-layer
entropy means match the dense path.

    python benchmarks/bench_capture.py [--sizes 512 2048] [--repeats 3] [--eager-repeats 1]
                                       [--threads T] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import math
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from common import cpu_model, put_peak_growth, run_children
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from attn_monitor.capture import consumers
from attn_monitor.capture.hooks import AttentionCapture

BATCH, LAYERS, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 2, 4, 256, 8, 4, 512, 1000
MODELS = ("llama", "nanogpt")
PATHS = ("unmonitored", "idle", "monitored", "output_attentions")
#: Paths whose peak memory is measured (idle allocates nothing over unmonitored).
MEMORY_PATHS = ("unmonitored", "monitored", "output_attentions")
#: Above this N the output_attentions path runs ``--eager-repeats`` times (it dominates the run time).
EAGER_FULL_REPEATS_UP_TO = 1024


# --------------------------------------------------------------------- nanoGPT
class CausalSelfAttention(nn.Module):
    """nanoGPT attention: fused SDPA, or (``eager``) the probabilities materialised and kept."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.eager = False
        self.probs: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.c_attn(x).split(hidden, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.eager:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
            probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
            self.probs = probs
            y = probs @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, seq, hidden))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int, max_seq: int, layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(max_seq, hidden)
        self.h = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def set_eager(self, eager: bool) -> None:
        for block in self.h:
            block.attn.eager = eager

    def forward(self, idx: Tensor) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def pop_probabilities(self) -> list[Tensor]:
        probs = [block.attn.probs for block in self.h]
        for block in self.h:
            block.attn.probs = None
        return probs


# ------------------------------------------------------------------- set-up
@dataclass
class Setup:
    """A model pair (sdpa, eager) sharing weights, one padded batch, and a capture on the sdpa model."""

    name: str
    sdpa: nn.Module
    eager: nn.Module
    input_ids: Tensor
    padding: Tensor
    capture: AttentionCapture


def make_batch(n: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Token ids and a right-padded 0/1 mask: row 0 full, row 1 three quarters long."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, n), generator=generator)
    lengths = torch.tensor([n, (3 * n) // 4])
    padding = (torch.arange(n)[None, :] < lengths[:, None]).long()
    return ids.masked_fill(padding == 0, 0), padding


def build_models(model: str, n: int, paths: tuple[str, ...] = ("sdpa", "eager")) -> dict[str, nn.Module]:
    """The requested implementations of ``model``, identical weights, eval mode."""
    torch.manual_seed(0)
    if model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            num_hidden_layers=LAYERS,
            hidden_size=HIDDEN,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            intermediate_size=INTERMEDIATE,
            vocab_size=VOCAB,
            max_position_embeddings=max(n, 2048),
            pad_token_id=0,
        )
        built = {kind: LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=kind) for kind in paths}
        reference = next(iter(built.values())).state_dict()
        for other in built.values():
            other.load_state_dict(reference)
    elif model == "nanogpt":
        base = NanoGPT(VOCAB, max(n, 2048), LAYERS, HIDDEN, HEADS)
        built = {}
        for kind in paths:
            built[kind] = copy.deepcopy(base)
            built[kind].set_eager(kind == "eager")
    else:
        raise ValueError(f"Unknown model {model!r}; expected one of {MODELS}.")
    return {kind: module.eval() for kind, module in built.items()}


def make_setup(model: str, n: int) -> Setup:
    models = build_models(model, n)
    ids, padding = make_batch(n)
    capture = AttentionCapture(models["sdpa"])
    return Setup(model, models["sdpa"], models["eager"], ids, padding, capture)


# -------------------------------------------------------------------- paths
def forward_sdpa(setup: Setup) -> None:
    if setup.name == "llama":
        setup.sdpa(input_ids=setup.input_ids, attention_mask=setup.padding)
    else:
        setup.sdpa(setup.input_ids)


def forward_monitored(setup: Setup) -> None:
    with setup.capture.recording(padding_mask=setup.padding):
        forward_sdpa(setup)


def eager_probabilities(setup: Setup) -> list[Tensor]:
    """Eager forward keeping every layer's (batch, heads, query, key) probabilities."""
    if setup.name == "llama":
        out = setup.eager(input_ids=setup.input_ids, attention_mask=setup.padding, output_attentions=True)
        return list(out.attentions)
    setup.eager(setup.input_ids)
    return setup.eager.pop_probabilities()


def dense_layer_means(probs: list[Tensor], padding: Tensor) -> tuple[Tensor, Tensor]:
    """Per-layer (normalised, nats) entropy means from probabilities, as a user would compute them.

    Entropy ``-sum p ln p`` over the support: softmax outputs are exactly 0 on
    hidden keys (``-inf`` or the dtype's minimum before the softmax), and
    ``entr(0) = 0``, so summing every key sums the support without a mask
    pass. Counted queries are real tokens with at least two visible keys
    (causal order and right padding: ``min(i + 1, length)`` keys), pooled over
    heads.
    """
    real = padding.bool()
    num_valid = torch.minimum(torch.arange(1, real.shape[1] + 1)[None, :], real.sum(-1, keepdim=True))
    counted = (real & (num_valid > 1))[:, None, :]
    log_valid = num_valid.clamp(min=2).to(torch.float32).log()[:, None, :]
    normalized, nats = [], []
    for p in probs:
        entropy = torch.special.entr(p).sum(-1)
        weight = counted.expand_as(entropy)
        nats.append(entropy[weight].mean())
        normalized.append((entropy / log_valid).clamp(0.0, 1.0)[weight].mean())
    return torch.stack(normalized), torch.stack(nats)


def forward_output_attentions(setup: Setup) -> tuple[Tensor, Tensor]:
    return dense_layer_means(eager_probabilities(setup), setup.padding)


#: path -> (attach the capture first?, callable). Attaching is outside the timed call.
RUNNERS: dict[str, tuple[bool, Callable[[Setup], object]]] = {
    "unmonitored": (False, forward_sdpa),
    "idle": (True, forward_sdpa),
    "monitored": (True, forward_monitored),
    "output_attentions": (False, forward_output_attentions),
}


def run_path(setup: Setup, path: str) -> float:
    """Seconds of one call of ``path`` (capture attached or detached beforehand, untimed)."""
    attached, runner = RUNNERS[path]
    if attached:
        setup.capture.attach()
    else:
        setup.capture.detach()
    setup.capture.metric.reset()
    with torch.no_grad():
        start = time.perf_counter()
        runner(setup)
        elapsed = time.perf_counter() - start
    setup.capture.detach()
    return elapsed


def time_paths(setup: Setup, repeats: int, eager_repeats: int) -> dict[str, float]:
    """Median seconds per path over interleaved rounds; the eager path joins only the first ``eager_repeats``.

    No separate warm-up: :func:`mean_difference` has already run every path once on these models.
    """
    samples: dict[str, list[float]] = {path: [] for path in PATHS}
    for round_index in range(max(repeats, eager_repeats)):
        for path in PATHS:
            limit = eager_repeats if path == "output_attentions" else repeats
            if round_index < limit:
                samples[path].append(run_path(setup, path))
    return {path: statistics.median(values) for path, values in samples.items()}


def mean_difference(setup: Setup) -> tuple[float, float]:
    """Largest |monitored - dense| per-layer entropy mean: (normalised, nats)."""
    setup.capture.metric.reset()
    with setup.capture, torch.no_grad():
        forward_monitored(setup)
        dense_norm, dense_nats = forward_output_attentions(setup)
    summary = setup.capture.metric.compute()
    setup.capture.metric.reset()
    if len(summary.layers) != LAYERS:
        raise RuntimeError(f"Expected {LAYERS} monitored layers, got {summary.layers}.")
    norm = (summary.layer_mean - dense_norm.double()).abs().max()
    nats = (summary.layer_nats_mean - dense_nats.double()).abs().max()
    return float(norm), float(nats)


class _SdpaClock(TorchFunctionMode):
    """Adds up the seconds spent in ``F.scaled_dot_product_attention`` calls (the model's own attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def __torch_function__(self, func: Callable, types: object, args: tuple = (), kwargs: dict | None = None) -> object:
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - start
        return out


def cost_split(setup: Setup, repeats: int) -> tuple[float, float]:
    """(model's attention, the monitor's entropy pass) seconds per forward, medians over ``repeats``.

    The first is timed in an unmonitored forward; the second adds up the
    monitor's ``entropy_from_qk`` calls in a monitored one. One extra pass
    over the model's q and k is the floor of the monitored / unmonitored
    ratio: 1 + entropy pass / unmonitored forward.
    """
    attention, entropy = [], []
    original = consumers.entropy_from_qk

    def timed(*args: object, **kwargs: object) -> Tensor:
        start = time.perf_counter()
        out = original(*args, **kwargs)  # type: ignore[arg-type]
        entropy[-1] += time.perf_counter() - start
        return out

    for _ in range(repeats):
        clock = _SdpaClock()
        with clock, torch.no_grad():
            forward_sdpa(setup)
        attention.append(clock.seconds)
        entropy.append(0.0)
        consumers.entropy_from_qk = timed  # type: ignore[assignment]
        try:
            run_path(setup, "monitored")
        finally:
            consumers.entropy_from_qk = original
    return statistics.median(attention), statistics.median(entropy)


# ------------------------------------------------------------------- memory
def _peak_child(model: str, path: str, n: int, threads: int, queue: multiprocessing.Queue) -> None:
    torch.set_num_threads(threads)
    kind = "eager" if path == "output_attentions" else "sdpa"
    module = build_models(model, n, (kind,))[kind]
    ids, padding = make_batch(n)
    setup = Setup(model, module, module, ids, padding, AttentionCapture(module))
    # One tiny forward first, so one-time start-up (thread pools, lazy imports) is not charged to the path.
    tiny = Setup(model, module, module, *make_batch(8), setup.capture)
    run_path(tiny, path)
    put_peak_growth(queue, lambda: run_path(setup, path))


def peak_memory(model: str, path: str, n: int) -> int:
    """Resident-set growth (bytes) of one forward of ``path`` in a fresh child process."""
    preload = ["torch", "attn_monitor.capture.hooks", "transformers.models.llama.modeling_llama"]
    (value,) = run_children(_peak_child, [(model, path, n, torch.get_num_threads())], 1, preload)
    return int(value)


def profile_monitored(setup: Setup, rows: int = 15) -> str:
    """Top operators (self CPU time) of one monitored forward, after a warm one."""
    from torch.profiler import profile

    run_path(setup, "monitored")
    with profile() as prof:
        run_path(setup, "monitored")
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


# ------------------------------------------------------------------- report
def machine() -> str:
    return f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def load_average() -> str:
    try:
        return f"load average {os.getloadavg()[0]:.1f}"
    except OSError:
        return "load average unknown"


def report(sizes: list[int], repeats: int, eager_repeats: int, profile: bool = False) -> str:
    lines = [
        f"One forward pass, batch {BATCH} right-padded (second row 3/4 long), {LAYERS} layers, hidden {HIDDEN}, "
        f"{HEADS} heads (llama: {KV_HEADS} kv heads), float32, eval, no_grad ({machine()}; {load_average()} "
        "at start).",
        f"Times: median of {repeats} interleaved repeats (output_attentions: {eager_repeats} for N > "
        f"{EAGER_FULL_REPEATS_UP_TO}), as ratios to the unmonitored sdpa forward; idle = capture attached, "
        "not recording.",
        "attention: the model's own SDPA calls, entropy pass: the monitor's `entropy_from_qk` calls, both as "
        "fractions of the unmonitored forward (medians of the same repeats); floor = 1 + entropy pass, what "
        "one extra pass over q and k costs; the rest of monitored - floor is the capture (reading q and k, the "
        "support, the metric update).",
        "Memory: peak resident growth of one forward in a fresh child. max abs d mean: monitored vs dense "
        "per-layer entropy means (normalised / nats).",
        "",
        "| model | N | unmonitored ms | idle x | monitored x | attention | entropy pass | floor x "
        "| output_attentions x | output_attentions / monitored "
        "| unmonitored MiB | monitored MiB | output_attentions MiB | max abs d mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    profiles = []
    for model in MODELS:
        for n in sizes:
            setup = make_setup(model, n)
            norm_diff, nats_diff = mean_difference(setup)
            times = time_paths(setup, repeats, repeats if n <= EAGER_FULL_REPEATS_UP_TO else eager_repeats)
            attention, entropy = cost_split(setup, repeats)
            if profile:
                profiles.append(f"\nmonitored forward, {model}, N={n}:\n{profile_monitored(setup)}")
            del setup
            memory = {path: peak_memory(model, path, n) / 2**20 for path in MEMORY_PATHS}
            base = times["unmonitored"]
            lines.append(
                f"| {model} | {n} | {base * 1e3:.1f} | {times['idle'] / base:.2f} | {times['monitored'] / base:.2f} "
                f"| {attention / base:.2f} | {entropy / base:.2f} | {1 + entropy / base:.2f} "
                f"| {times['output_attentions'] / base:.2f} | {times['output_attentions'] / times['monitored']:.2f} "
                f"| {memory['unmonitored']:.0f} | {memory['monitored']:.0f} | {memory['output_attentions']:.0f} "
                f"| {norm_diff:.1e} / {nats_diff:.1e} |"
            )
    return "\n".join(lines + profiles)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--eager-repeats",
        type=int,
        default=1,
        help=f"repeats of the slow output_attentions path for N > {EAGER_FULL_REPEATS_UP_TO} (default 1)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--profile", action="store_true", help="also print the top operators of a monitored forward")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    table = report(args.sizes, args.repeats, args.eager_repeats, args.profile)
    table += f"\n\nTotal {time.perf_counter() - start:.0f} s."
    print(table)
    return table


if __name__ == "__main__":
    main()
