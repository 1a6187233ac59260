"""Watch attention entropy fall while a tiny GPT learns to copy (``make demo``).

The story, in three steps:

1. **A copy task.** Every sequence is ``BOS x_1 .. x_n`` said twice,
   ``BOS x_1 .. x_n BOS x_1 .. x_n``, with ``n`` distinct random tokens and a
   random ``n``, right-padded into a batch. The first half is noise and cannot
   be predicted; every token of the second half after its ``BOS`` can, by
   looking back at the first half. The loss counts only those tokens.
2. **Induction heads.** The tokens are random and ``n`` varies, so no bigram
   statistic or fixed offset helps: the model has to find where the current
   token occurred before and copy the token that followed it. A two-layer
   Transformer learns this as an *induction* circuit: first-layer heads write
   "which token came before me" into each position, and second-layer heads
   match on it and attend to the one key that holds the next token.
3. **Entropy falls.** At initialisation every head spreads its attention
   almost uniformly over the keys it may see (normalised entropy near 1). As
   the copy accuracy jumps from chance to ~100%, the second layer's heads
   sharpen onto single keys and its entropy falls the most; the first layer
   falls less. (Queries in the first half have nothing to copy and stay more
   diffuse: they are counted too, as every real token is.)
4. **Distance shows where heads look.** For a query of the second half the
   token to copy sits exactly ``n`` positions back, so an induction head's
   mean attention distance over those queries moves to ``n`` (about 10 here,
   from about 8 at initialisation); the first layer's heads do not. The
   script measures it with
   :func:`~attn_monitor.capture.evaluate.evaluate_attention` before and after training,
   counting only the copy queries; the monitor also logs every head's
   distance over all real queries (``attn_distance_heads/...``).

:class:`~attn_monitor.lightning.callback.AttentionEntropyMonitor` records this on the
same two validation batches after every epoch and logs it to TensorBoard (and
to W&B, offline, with ``--wandb``). At the end the script prints how each
layer's mean entropy changed, the sharpest head of each layer, each head's
mean attention distance and the copy accuracy, and saves the layer x head
heatmaps of the first and last epoch and each layer's heads-over-training
picture under ``runs/pictures``::

    .venv/bin/python examples/train_tiny_gpt.py    # about a minute on 2 CPU cores
    .venv/bin/tensorboard --logdir runs            # Custom Scalars: one chart per layer
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from attn_monitor import Statistics
from attn_monitor.capture.consumers import StatisticsUpdate
from attn_monitor.capture.evaluate import evaluate_attention
from attn_monitor.lightning.callback import AttentionEntropyMonitor
from attn_monitor.metrics.entropy import EntropySummary
from attn_monitor.metrics.statistics import StatisticsSummary
from attn_monitor.report.figures import history_picture, save_heatmap

PAD, BOS = 0, 1
VOCAB = 32  # PAD, BOS and 30 ordinary tokens
MIN_TOKENS, MAX_TOKENS = 6, 14  # n: tokens in each half after its BOS
MAX_LEN = 2 * (MAX_TOKENS + 1)


# --------------------------------------------------------------------------- data


class CopyDataset(Dataset):
    """``BOS x_1 .. x_n BOS x_1 .. x_n`` with random tokens and random ``n``, right-padded.

    Items are dicts ``{"input_ids": (MAX_LEN,), "attention_mask": (MAX_LEN,)}``
    (Hugging Face style: the monitor reads ``attention_mask`` to leave padding
    queries out).
    """

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        half = torch.randint(MIN_TOKENS, MAX_TOKENS + 1, (size, 1), generator=generator) + 1  # BOS + n tokens
        # Distinct tokens within a sequence, so the earlier occurrence of a token is unique and copying unambiguous.
        tokens = torch.rand(size, VOCAB - 2, generator=generator).argsort(1)[:, :MAX_TOKENS] + 2
        position = torch.arange(MAX_LEN)[None, :]
        within = position % half  # position inside its half; 0 is the BOS
        copied = tokens.gather(1, (within - 1).clamp(min=0))
        real = position < 2 * half
        self.input_ids = torch.where(within == 0, BOS, copied).masked_fill(~real, PAD)
        self.attention_mask = real.long()

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index]}


def copy_targets(attention_mask: Tensor) -> Tensor:
    """(batch, seq - 1) True where the next token is predictable: second half, after its BOS.

    Position ``t`` predicts token ``t + 1``; with ``2h`` real tokens the
    predictable ones are ``h + 1 .. 2h - 1``.
    """
    length = attention_mask.sum(1, keepdim=True)
    target = torch.arange(1, attention_mask.shape[1], device=attention_mask.device)[None, :]
    return (target > length // 2) & (target < length)


# --------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention`` (what the monitor sees)."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """x: (batch, seq, d_model); mask: (batch, 1, seq, seq) bool, True = visible."""
        batch, seq, d_model = x.shape
        q, k, v = (
            part.view(batch, seq, self.num_heads, -1).transpose(1, 2) for part in self.qkv(x).split(d_model, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(batch, seq, d_model))


class Block(nn.Module):
    """Pre-LayerNorm Transformer block."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, num_heads)
        self.ln_mlp = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x + self.attn(self.ln_attn(x), mask)
        return x + self.mlp(self.ln_mlp(x))


class TinyGPT(nn.Module):
    """nanoGPT-style decoder: token + position embeddings, pre-LN blocks, a linear head."""

    def __init__(self, num_layers: int = 2, d_model: int = 64, num_heads: int = 4) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB, d_model)
        self.position_embedding = nn.Embedding(MAX_LEN, d_model)
        self.blocks = nn.ModuleList(Block(d_model, num_heads) for _ in range(num_layers))
        self.ln_final = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(batch, seq) ids and 0/1 padding mask -> (batch, seq, vocab) next-token logits."""
        seq = input_ids.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=input_ids.device).tril()
        # Causal AND the batch's padding: a query sees earlier real tokens only.
        mask = causal[None, None, :, :] & attention_mask.bool()[:, None, None, :]
        x = self.token_embedding(input_ids) + self.position_embedding(torch.arange(seq, device=input_ids.device))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_final(x))


class CopyModel(pl.LightningModule):
    """Trains :class:`TinyGPT` on the copy loss: cross-entropy on the predictable tokens only."""

    def __init__(self, num_layers: int, lr: float, total_steps: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.gpt = TinyGPT(num_layers)
        self.lr = lr
        self.total_steps = total_steps

    @override
    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.gpt(input_ids, attention_mask)

    def _step(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """(loss, correct predictions, predictions) on the copy targets of ``batch``."""
        logits = self(batch["input_ids"], batch["attention_mask"])[:, :-1]
        targets = batch["input_ids"][:, 1:]
        counted = copy_targets(batch["attention_mask"])
        loss = F.cross_entropy(logits[counted], targets[counted])
        correct = (logits.argmax(-1) == targets)[counted].sum()
        return loss, correct, counted.sum()

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, _, _ = self._step(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, correct, total = self._step(batch)
        size = int(total)
        self.log("val/loss", loss, batch_size=size)
        self.log("val/copy_accuracy", correct / total, batch_size=size, prog_bar=True)

    @override
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        warmup = max(1, self.total_steps // 20)

        def schedule(step: int) -> float:  # linear warm-up, cosine decay to 10%
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, self.total_steps - warmup))
            return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# --------------------------------------------------------------------------- reporting


class History(pl.Callback):
    """Keeps the monitor's summary and the copy accuracy of every validation epoch."""

    def __init__(self, monitor: AttentionEntropyMonitor) -> None:
        self.monitor = monitor
        self.summaries: list[EntropySummary] = []
        self.accuracies: list[float] = []
        self.epochs: list[int] = []

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation (and the monitor's logging) has finished by the end of the training epoch.
        summary = self.monitor.last_summary
        if summary is None or (self.summaries and summary is self.summaries[-1]):
            return
        accuracy = float(trainer.callback_metrics["val/copy_accuracy"])
        self.summaries.append(summary)
        self.accuracies.append(accuracy)
        self.epochs.append(trainer.current_epoch)
        means = "  ".join(
            f"{layer}={mean:.3f}" for layer, mean in zip(summary.layers, summary.layer_mean.tolist(), strict=True)
        )
        print(f"epoch {trainer.current_epoch:2d}  copy accuracy {accuracy:6.1%}  mean entropy  {means}")


def copy_queries(batch: dict[str, Tensor]) -> Tensor:
    """(batch, seq) True for the queries whose next token is copied: the token to copy is ``n`` positions back."""
    return F.pad(copy_targets(batch["attention_mask"]), (0, 1))


def copy_distance(model: nn.Module, batches: list[dict[str, Tensor]]) -> StatisticsSummary:
    """Each head's mean attention distance over the copy queries of ``batches`` (no Lightning needed)."""
    update = StatisticsUpdate(max_logit=False)
    evaluate_attention(model, batches, padding_mask=copy_queries, consumers=[update])
    return update.metric.compute()


def report(history: History, untrained: StatisticsSummary, trained: StatisticsSummary, offset: float) -> None:
    """Per-layer table: mean entropy first -> last epoch, the sharpest head of each layer; each head's distance."""
    first, last = history.summaries[0], history.summaries[-1]
    first_median, last_median = first.quantile(0.5), last.quantile(0.5)
    print()
    print("Normalised attention entropy (0 = one key, 1 = uniform), validation batches 0-1")
    header = (
        f"{'layer':<16} {'first epoch':>11} {'last epoch':>10} {'change':>7}   sharpest head (median, first -> last)"
    )
    print(header)
    print("-" * len(header))
    for index, layer in enumerate(last.layers):
        before, after = float(first.layer_mean[index]), float(last.layer_mean[index])
        head = int(last_median[index].argmin())
        print(
            f"{layer:<16} {before:>11.3f} {after:>10.3f} {after - before:>+7.3f}   "
            f"head {head}: {float(first_median[index, head]):.3f} -> {float(last_median[index, head]):.3f}"
        )
    print()
    print(f"Mean attention distance of the copy queries, per head (before -> after training; copy offset {offset:.1f})")
    for index, layer in enumerate(trained.layers):
        heads = "  ".join(
            f"h{head} {float(untrained.distance[index, head]):4.1f} -> {float(trained.distance[index, head]):4.1f}"
            for head in range(trained.num_heads[index])
        )
        print(f"{layer:<16} {heads}")
    print()
    print(f"Copy accuracy on held-out sequences: {history.accuracies[0]:.1%} -> {history.accuracies[-1]:.1%}")


# --------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a tiny GPT on a copy task and watch its attention entropy fall."
    )
    parser.add_argument("--epochs", type=int, default=10, help="training epochs (default: %(default)s)")
    parser.add_argument("--logdir", default="runs", help="TensorBoard (and W&B) log directory (default: %(default)s)")
    parser.add_argument("--wandb", action="store_true", help="also log to Weights & Biases, offline")
    parser.add_argument(
        "--out", default=os.path.join("runs", "pictures"), help="where to write the pictures (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    # Tiny matrices: extra threads add synchronisation, not speed, and stall badly on shared cores.
    torch.set_num_threads(1)
    pl.seed_everything(args.seed, verbose=False)

    batch_size, train_size = 64, 64 * 40  # 40 steps an epoch
    train = DataLoader(CopyDataset(train_size, seed=args.seed + 1), batch_size=batch_size, shuffle=True)
    val_set = CopyDataset(8 * batch_size, seed=args.seed + 2)
    val = DataLoader(val_set, batch_size=batch_size)
    model = CopyModel(num_layers=2, lr=2e-3, total_steps=args.epochs * len(train))

    # Per-layer and per-head entropy on the same two validation batches every epoch.
    # The monitor watches the GPT itself, so layers are named "blocks.0.attn", "blocks.1.attn".
    # Statistics(distance=True) also logs each head's mean attention distance (attn_distance_heads/... in TensorBoard).
    monitor = AttentionEntropyMonitor(
        batches=2,
        statistics=Statistics(distance=True),
        module=lambda module: module.gpt,
        save_summaries=True,
    )
    history = History(monitor)
    loggers: list[Logger] = [TensorBoardLogger(args.logdir, name="tiny_gpt")]
    if args.wandb:
        os.environ["WANDB_MODE"] = "offline"  # never sync from the demo
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(WandbLogger(project="attn_monitor-demo", save_dir=args.logdir, offline=True))

    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=1,
        logger=loggers,
        callbacks=[monitor, history],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=20,
        deterministic=True,
    )
    # The first validation batch, for the copy-query distance (read directly: a DataLoader iterator draws a seed).
    probe = [{"input_ids": val_set.input_ids[:batch_size], "attention_mask": val_set.attention_mask[:batch_size]}]
    counted = copy_queries(probe[0])
    # Every copy query of a sequence with n tokens per half looks exactly n back.
    offset = float((counted.sum(1) * counted.sum(1)).sum() / counted.sum())
    before = copy_distance(model.gpt, probe)
    trainer.fit(model, train, val)

    report(history, before, copy_distance(model.gpt, probe), offset)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for index, name in ((0, "heatmap_epoch0.png"), (-1, "heatmap.png")):
        title = f"Epoch {history.epochs[index]}: median entropy of each head"
        save_heatmap(history.summaries[index], str(out / name), title=title)
    from PIL import Image

    for layer in history.summaries[-1].layers:
        steps, medians = monitor.core.dashboards.medians_over_time(layer, prefix=monitor.core.options.prefix)
        Image.fromarray(history_picture(layer, steps, medians).pixels).save(out / f"over_training_{layer}.png")
    print(f"Pictures: {out}/heatmap_epoch0.png (first epoch), heatmap.png (last), over_training_<layer>.png")
    print(f"TensorBoard logs: {loggers[0].log_dir}")
    print("  open them with (then http://localhost:6006):")
    print(f"    .venv/bin/tensorboard --logdir {shlex.quote(args.logdir)}")
    if args.wandb:
        print(f"W&B offline run: {Path(args.logdir) / 'wandb'}")
        print("  upload it with:")
        print(f"    .venv/bin/wandb sync {shlex.quote(str(Path(args.logdir) / 'wandb'))}/offline-run-*")
    print(f"Finished in {time.perf_counter() - start:.0f} s.")


if __name__ == "__main__":
    main()
