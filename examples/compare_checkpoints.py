"""Compare the attention of two checkpoints on the same batches, in Python and from the shell.

Before/after questions (did the fine-tune sharpen a layer? which heads moved
most?) come down to: run both checkpoints over the same evaluation batches,
summarise each, compare the two summaries head by head. This example:

1. trains the tiny copy-task GPT of ``train_tiny_gpt.py`` (same model, same
   data, imported from it) for six epochs without Lightning (copy accuracy
   from chance to ~98%), saving the weights after the first and the last one;
2. loads each checkpoint into a fresh model and runs
   :func:`~attn_monitor.capture.evaluate.evaluate_attention` on the same fixed
   validation batches, writing each summary with
   :func:`~attn_monitor.report.archive.save_summary`;
3. loads both summaries back, compares them with
   :func:`~attn_monitor.report.comparison.compare` and prints the ten heads whose
   entropy distribution moved most (Wasserstein-1 distance), then writes the
   layer x head heatmap of W1 to ``runs/pictures/compare_w1.png``;
4. runs the same comparison with the command line, as you would from a shell::

       attn-monitor compare epoch0_entropy.pt epoch5_entropy.pt --top 5 --heatmap runs/pictures/cli_w1.png

Run it with::

    python examples/compare_checkpoints.py    # about 30 s on 2 CPU cores
"""

from __future__ import annotations

import argparse
import math
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

# The copy task and model live in the sibling demo script.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny_gpt import CopyDataset, TinyGPT, copy_targets

from attn_monitor import compare, evaluate_attention, load_summary, save_summary

STEPS_PER_EPOCH, BATCH_SIZE = 40, 64


def copy_loss(model: TinyGPT, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, correct predictions, predictions) on the predictable tokens of ``batch``."""
    logits = model(batch["input_ids"], batch["attention_mask"])[:, :-1]
    targets = batch["input_ids"][:, 1:]
    counted = copy_targets(batch["attention_mask"])
    loss = F.cross_entropy(logits[counted], targets[counted])
    return loss, (logits.argmax(-1) == targets)[counted].sum(), counted.sum()


def train(epochs: int, seed: int, out: Path) -> dict[str, Path]:
    """Train for ``epochs`` epochs; save the weights after the first and the last one. Returns name -> file."""
    torch.manual_seed(seed)
    model = TinyGPT(num_layers=2)
    data = CopyDataset(STEPS_PER_EPOCH * BATCH_SIZE, seed=seed + 1)
    loader = DataLoader(data, batch_size=BATCH_SIZE, shuffle=True, generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    total, warmup = epochs * len(loader), max(1, epochs * len(loader) // 20)

    def schedule(step: int) -> float:  # as in train_tiny_gpt.py: linear warm-up, cosine decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    checkpoints = {}
    for epoch in range(epochs):
        model.train()
        for batch in loader:
            loss, _, _ = copy_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
        print(f"  epoch {epoch}  train loss {loss.item():.3f}")
        if epoch in (0, epochs - 1):
            name = "epoch0" if epoch == 0 else f"epoch{epoch}"
            checkpoints[name] = out / f"{name}_weights.pt"
            torch.save(model.state_dict(), checkpoints[name])
    return checkpoints


def load(path: Path) -> TinyGPT:
    """A fresh model with the weights of ``path``."""
    model = TinyGPT(num_layers=2)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model


def accuracy(model: TinyGPT, batches: list[dict[str, Tensor]]) -> float:
    model.eval()
    with torch.no_grad():
        results = [copy_loss(model, batch) for batch in batches]
    return float(sum(correct for _, correct, _ in results) / sum(total for _, _, total in results))


def cli() -> list[str]:
    """The ``attn-monitor`` command of this environment (or ``python -m attn_monitor`` without one)."""
    for candidate in (Path(sys.executable).parent / "attn-monitor", shutil.which("attn-monitor")):
        if candidate and Path(candidate).exists():
            return [str(candidate)]
    return [sys.executable, "-m", "attn_monitor"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a tiny GPT, then compare the attention of two checkpoints.")
    parser.add_argument("--epochs", type=int, default=6, help="training epochs, at least 2 (default: %(default)s)")
    parser.add_argument("--out", help="folder for checkpoints and summaries (default: a temporary folder)")
    parser.add_argument(
        "--heatmap", default="runs/pictures/compare_w1.png", help="W1 heatmap to write (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (two different checkpoints)")
    return args


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="attn_monitor-compare-"))
    out.mkdir(parents=True, exist_ok=True)

    print(f"Training the tiny copy-task GPT for {args.epochs} epochs of {STEPS_PER_EPOCH} steps:")
    checkpoints = train(args.epochs, args.seed, out)

    # The same evaluation batches for both checkpoints: held-out sequences, fixed seed.
    batches = list(DataLoader(CopyDataset(2 * BATCH_SIZE, seed=args.seed + 2), batch_size=BATCH_SIZE))
    summaries = {}
    print()
    for name, path in checkpoints.items():
        model = load(path)
        summary = evaluate_attention(model, batches)  # eval mode, no gradients; padding from attention_mask
        summaries[name] = out / f"{name}_entropy.pt"
        save_summary(summary, summaries[name])
        means = "  ".join(
            f"{layer}={mean:.3f}" for layer, mean in zip(summary.layers, summary.layer_mean.tolist(), strict=True)
        )
        print(f"{name:>7}: copy accuracy {accuracy(model, batches):6.1%}  mean entropy  {means}")
        print(f"         {path.name} -> {summaries[name].name}")

    (name_a, path_a), (name_b, path_b) = summaries.items()
    comparison = compare(load_summary(path_a), load_summary(path_b))
    print(f"\nA = {name_a}, B = {name_b}")
    print(comparison.table(top=10))
    heatmap = Path(args.heatmap)
    heatmap.parent.mkdir(parents=True, exist_ok=True)
    comparison.heatmap(heatmap, title=f"Normalised attention entropy, {name_b} vs {name_a}:\nW1 distance")
    print(f"W1 heatmap written to {heatmap}")

    # The same comparison from the shell.
    shell_heatmap = str(heatmap.with_name("cli_w1.png"))
    command = [*cli(), "compare", str(path_a), str(path_b), "--top", "5", "--heatmap", shell_heatmap]
    print(f"\nFrom the shell:\n  {shlex.join(command)}")
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    print(result.stdout, end="")
    if result.returncode != 0:
        print(result.stderr, end="", file=sys.stderr)
        raise SystemExit(f"attn-monitor exited with status {result.returncode}")
    print(f"\nCheckpoints and summaries are in {out}")
    print(f"Finished in {time.perf_counter() - start:.0f} s.")


if __name__ == "__main__":
    main()
