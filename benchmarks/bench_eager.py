"""Cost of recording Hugging Face ``eager`` attention, read from its softmax's logits.

For each model: the plain eval forward, and the same forward while a batch
is recorded (entropy of every layer). Rounds are interleaved (plain,
recorded, plain, ...), and medians with ranges are printed side by side with
their ratio. Run it against another checkout with ``PYTHONPATH=that/checkout``
to compare readers.

    python benchmarks/bench_eager.py [--seq 256] [--batch 4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
import transformers

from attn_monitor.capture.hooks import AttentionCapture


def gpt2(seq: int) -> transformers.PreTrainedModel:
    config = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=8, n_positions=seq, vocab_size=512)
    return transformers.GPT2LMHeadModel._from_config(copy.deepcopy(config), attn_implementation="eager")


def gpt_neo(seq: int) -> transformers.PreTrainedModel:
    config = transformers.GPTNeoConfig(
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        attention_types=[[["global", "local"], 2]],
        window_size=64,
        max_position_embeddings=seq,
        vocab_size=512,
    )
    return transformers.GPTNeoForCausalLM._from_config(copy.deepcopy(config), attn_implementation="eager")


MODELS: dict[str, Callable[[int], transformers.PreTrainedModel]] = {"gpt2": gpt2, "gpt_neo": gpt_neo}


def seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(model: transformers.PreTrainedModel, batch: int, seq: int, repeats: int) -> dict[str, list[float]]:
    """Interleaved seconds of the plain and the recorded forward, ``repeats`` rounds after one warm-up."""
    ids = torch.randint(0, 512, (batch, seq))
    mask = torch.ones_like(ids)
    mask[1:, seq // 2 :] = 0  # right padding in all rows but the first
    times: dict[str, list[float]] = {"plain": [], "recorded": []}
    with AttentionCapture(model) as capture, torch.no_grad():

        def plain() -> object:
            return model(input_ids=ids, attention_mask=mask)

        def recorded() -> object:
            with capture.recording(mask):
                return model(input_ids=ids, attention_mask=mask)

        plain(), recorded()
        for _ in range(repeats):
            times["plain"].append(seconds(plain))
            times["recorded"].append(seconds(recorded))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"B={args.batch}, N={args.seq}, hidden 256, 8 heads, 4 layers, float32, {torch.get_num_threads()} threads")
    print("| model | plain forward (ms) | recorded forward (ms) | ratio |")
    print("|---|---|---|---|")
    for name, build in MODELS.items():
        times = measure(build(args.seq).eval(), args.batch, args.seq, args.repeats)
        cells = []
        for key in ("plain", "recorded"):
            values = [1e3 * t for t in times[key]]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
        ratio = statistics.median(times["recorded"]) / statistics.median(times["plain"])
        print(f"| {name} | {cells[0]} | {cells[1]} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
