"""The monitor in a Hugging Face ``transformers.Trainer``: one callback, the Trainer's own TensorBoard run.

A tiny GPT-2 (2 layers, 4 heads, random weights from a config) learns a copy
task (``x_1 .. x_n x_1 .. x_n``) for 60 steps on CPU, evaluating every 20;
``AttentionEntropyCallback`` records the first 2 evaluation batches of every
evaluation and writes into the directory the Trainer's TensorBoardCallback
writes ``eval/loss`` to::

    python examples/hf_trainer.py [output_dir]     # about 20 s on 2 CPU cores
    tensorboard --logdir {output_dir}/runs
"""

from __future__ import annotations

import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from attn_monitor import AttentionEntropyCallback

VOCAB, HALF = 32, 8


def copy_examples(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` rows ``x x`` of random ids; the loss is on the second half only."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        half = torch.randint(1, VOCAB, (HALF,), generator=generator)
        ids = torch.cat([half, half])
        labels = ids.clone()
        labels[:HALF] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return rows


def main(output_dir: str) -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=2 * HALF, n_embd=64, n_layer=2, n_head=4)
    model = GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    args = TrainingArguments(
        output_dir=output_dir,
        eval_strategy="steps",
        eval_steps=20,
        max_steps=60,
        learning_rate=3e-3,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        logging_steps=20,
        save_strategy="no",
        report_to=["tensorboard"],
        use_cpu=True,
        disable_tqdm=True,
    )
    monitor = AttentionEntropyCallback()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=copy_examples(960, seed=1),
        eval_dataset=copy_examples(64, seed=2),
        callbacks=[monitor],
    )
    trainer.train()
    for entry in trainer.state.log_history:
        if "eval_loss" in entry:
            print(f"step {entry['step']}: eval_loss {entry['eval_loss']:.3f}")
    print(f"attention entropy at the last evaluation: {monitor.core.last_summaries[0].overall_mean:.3f}")
    print(f"TensorBoard: tensorboard --logdir {output_dir}/runs   (attn_entropy/... beside eval/loss)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="attn_monitor_hf_"))
