"""The monitor in a Lightning Fabric loop, written through Fabric's own TensorBoard and CSV loggers.

A tiny causal Transformer (two ``nn.TransformerEncoderLayer`` blocks with a
causal mask, random weights) learns a copy task for 60 steps on CPU;
every 20 steps a validation records its first 2 batches with
:class:`~attn_monitor.monitor.core.MonitorCore`, whose sinks are Fabric's loggers
(:func:`~attn_monitor.lightning.fabric.fabric_sinks`)::

    python examples/fabric_loop.py [log_dir]     # a few seconds on 2 CPU cores
    tensorboard --logdir {log_dir}
"""

from __future__ import annotations

import sys
import tempfile

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
from torch import nn

from attn_monitor import MonitorCore, fabric_sinks

VOCAB, HALF, DIM = 32, 8, 64


class CopyModel(nn.Module):
    """Embeddings, two causal encoder layers (``nn.MultiheadAttention`` inside), an LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Embedding(2 * HALF, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=input_ids.device)
        x = self.embed(input_ids) + self.position(torch.arange(length, device=input_ids.device))
        return self.head(self.blocks(x, mask=causal, is_causal=True))


def copy_batches(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    half = [torch.randint(1, VOCAB, (16, HALF), generator=generator) for _ in range(count)]
    return [{"input_ids": torch.cat([h, h], dim=1)} for h in half]


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = batch["input_ids"]
    logits = model(**batch)[:, HALF - 1 : -1]
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, HALF:].reshape(-1))


def main(log_dir: str) -> None:
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[TensorBoardLogger(log_dir, "tb"), CSVLogger(log_dir, "csv")])
    model = CopyModel()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    train, val = copy_batches(60, seed=1), copy_batches(4, seed=2)
    core = MonitorCore(batches=2, say=fabric.print)
    core.attach(model, fabric_sinks(fabric), device=fabric.device)
    for step, batch in enumerate(train, start=1):
        model.train()
        loss = loss_of(model, batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 20 == 0 and core.validation_start(epoch=step // 20 - 1):
            model.eval()
            with torch.no_grad():
                losses = []
                for index, val_batch in enumerate(val):
                    with core.recording(index, val_batch, num_batches=len(val)):
                        losses.append(float(loss_of(model, val_batch)))
            outcome = core.validation_end(step, loop_names=["val_loss"])
            fabric.log("val_loss", sum(losses) / len(losses), step=step)
            fabric.print(f"step {step}: val_loss {sum(losses) / len(losses):.3f}, "
                         f"attn_entropy/mean {outcome.scalars['attn_entropy/mean']:.3f}")  # fmt: skip
    core.training_end()
    core.release()
    for logger in fabric.loggers:
        logger.finalize("success")
    tensorboard, csv = fabric.loggers
    fabric.print(f"TensorBoard: tensorboard --logdir {tensorboard.log_dir}   CSV: {csv.log_dir}/metrics.csv")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="attn_monitor_fabric_"))
