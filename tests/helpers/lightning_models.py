"""Tiny LightningModules, data and recording helpers for the callback tests.

Nothing here imports attn_monitor. Sizes: hidden 32, 2 layers, 4 heads, token
sequences of 12 with right padding.

* :class:`TinyGPT`: nanoGPT-style blocks whose attention calls
  ``F.scaled_dot_product_attention`` with a bool ``attn_mask`` that combines
  causal order with the batch's ``attention_mask`` (padding keys hidden).
* :class:`HFLM`: a tiny random Hugging Face causal LM (``attn_implementation
  ="sdpa"``) wrapped in a LightningModule.
* :class:`LoraLM`: that GPT-2 under PEFT LoRA adapters (random, not a no-op);
  :class:`CompiledGPT`: a :class:`TinyGPT` compiled before fit: the wrappers
  whose name segments the monitor drops.
* :class:`BatchRecorder`: a callback that keeps, independently of the monitor,
  the weights and the batches of every validation run (and of chosen training
  steps), so a test can recompute entropy after ``fit``.
* :class:`MemoryLogger`: a Lightning logger that keeps what it is given;
  :class:`WarningsToFile`: the warnings of each (DDP) process, on disk.

Both modules take dict batches ``{"input_ids", "attention_mask"}`` and can be
told to raise inside a validation or training step; :class:`TinyGPT` can be
told to diverge (NaN activations) on one validation batch.
"""

from __future__ import annotations

import copy
import math
import warnings
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor, nn

from tests.helpers import models

HIDDEN = 32
HEADS = 4
LAYERS = 2
VOCAB = models.VOCAB
SEQ = 12
BATCH = 4

#: Names of the attention modules, relative to the LightningModule.
GPT_LAYERS = ["blocks.0.attn", "blocks.1.attn"]
HF_LAYERS = ["model.transformer.h.0.attn", "model.transformer.h.1.attn"]


# --------------------------------------------------------------------------- data


def make_batches(count: int, seed: int, batch: int = BATCH, seq: int = SEQ) -> list[dict[str, Tensor]]:
    """``count`` dict batches of random ids with right padding, all different.

    Every batch has one full row; the other rows have random lengths in
    ``[2, seq]`` (padding ids are 0).
    """
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(1, VOCAB, (batch, seq), generator=generator)
        lengths = torch.randint(2, seq + 1, (batch,), generator=generator)
        lengths[0] = seq
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        out.append({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask})
    return out


def loader(batches: list[dict[str, Tensor]]) -> torch.utils.data.DataLoader:
    """A DataLoader that yields the prepared batches as they are (``batch_size=None``)."""
    return torch.utils.data.DataLoader(batches, batch_size=None)


def lm_loss(logits: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
    """Next-token cross entropy over real tokens."""
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


# --------------------------------------------------------------------------- plain PyTorch model


class CausalSelfAttention(nn.Module):
    """nanoGPT attention; the SDPA mask is causal AND the key padding of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = HEADS
        self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.c_proj = nn.Linear(HIDDEN, HIDDEN)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, C) -> q, k, v of shape (B, heads, T, head_dim)."""
        batch, length, dim = x.shape
        parts = self.c_attn(x).split(dim, dim=2)
        return tuple(t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in parts)

    @staticmethod
    def mask(attention_mask: Tensor) -> Tensor:
        """(B, T) 0/1 -> (B, 1, T, T) bool, True = visible."""
        length = attention_mask.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
        return causal[None, None] & attention_mask.bool()[:, None, None, :]

    def forward(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        q, k, v = self.qkv(x)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(attention_mask))
        return self.c_proj(y.transpose(1, 2).reshape(x.shape))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(HIDDEN)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x), attention_mask)
        return x + self.mlp(self.ln_2(x))


class _LMSteps(pl.LightningModule):
    """Language-model steps shared by the test modules; raise inside chosen validation or training steps."""

    fail_on_val_batch: int | None = None
    fail_on_train_batch: int | None = None
    #: What a chosen step raises: RuntimeError, or KeyboardInterrupt as Ctrl-C would.
    fail_with: type[BaseException] = RuntimeError
    nan_on_val_batch: int | None = None
    lr: float
    _diverging = False

    def _maybe_fail(self, kind: str, batch_idx: int) -> None:
        target = self.fail_on_val_batch if kind == "val" else self.fail_on_train_batch
        if target is not None and batch_idx == target:
            raise self.fail_with(f"{kind} step {batch_idx} failed on purpose")

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self._maybe_fail("train", batch_idx)
        loss = lm_loss(self(**batch), batch)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._maybe_fail("val", batch_idx)
        self._diverging = batch_idx == self.nan_on_val_batch
        try:
            self.log("val_loss", lm_loss(self(**batch), batch))
        finally:
            self._diverging = False

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


class TinyGPT(_LMSteps):
    """Embeddings, two pre-norm blocks, LM head; ``forward(input_ids, attention_mask)``."""

    def __init__(self, lr: float = 1e-2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lr = lr
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def embed(self, input_ids: Tensor) -> Tensor:
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        return x * math.nan if self._diverging else x

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, attention_mask)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------- Hugging Face model


class HFLM(_LMSteps):
    """A tiny random ``family`` causal LM (sdpa attention by default) as a LightningModule; ``self.model`` is it."""

    def __init__(
        self,
        family: str = "gpt2",
        lr: float = 1e-2,
        seed: int = 0,
        implementation: str = "sdpa",
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.lr = lr
        self.model = models.hf_model(family, implementation, seed=seed).train()
        if gradient_checkpointing:  # backward() reruns each layer's forward
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


class LoraLM(_LMSteps):
    """The tiny GPT-2 of :class:`HFLM` with PEFT LoRA adapters on ``c_attn``, randomly initialised (not a no-op).

    ``self.model`` is the ``PeftModel``: its attention modules are named
    ``model.base_model.model.transformer.h.{i}.attn``.
    """

    def __init__(self, lr: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        import peft

        self.lr = lr
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], init_lora_weights=False)
        torch.manual_seed(seed)
        self.model = peft.get_peft_model(models.hf_model("gpt2", "sdpa", seed=seed), config)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def merged_state(self) -> dict[str, Tensor]:
        """The plain GPT-2 weights with the adapters merged in, named as :class:`HFLM`'s (``model.`` prefix)."""
        merged = copy.deepcopy(self.model).merge_and_unload()
        return {f"model.{name}": value for name, value in merged.state_dict().items()}


class CompiledGPT(_LMSteps):
    """A :class:`TinyGPT` compiled (``aot_eager``) before fit, as ``self.model``: ``model._orig_mod.blocks...``."""

    def __init__(self, lr: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        self.lr = lr
        self.inner = [TinyGPT(seed=seed)]  # a list: not a second child module
        self.model = torch.compile(self.inner[0], backend="aot_eager")

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model(input_ids, attention_mask)


# --------------------------------------------------------------------------- recording helpers


def _clone(batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return {key: _clone(value) for key, value in batch.items()}
    return batch.detach().clone().cpu() if isinstance(batch, Tensor) else copy.deepcopy(batch)


class BatchRecorder(pl.Callback):
    """Keep the weights and batches the model saw, to recompute entropy after ``fit``.

    Attributes:
        validations: one entry per validation run (sanity check excluded):
            ``{"step": global_step, "epoch": current_epoch, "state": weights,
            "batches": [batch, ...]}`` with every validation batch in order.
        train: one entry per training batch whose global step is a multiple of
            ``train_every`` (when set): ``{"step", "state", "batch"}``, the
            weights being those the forward pass used.
    """

    def __init__(self, train_every: int | None = None) -> None:
        self.train_every = train_every
        self.validations: list[dict[str, Any]] = []
        self.train: list[dict[str, Any]] = []

    @staticmethod
    def _state(module: nn.Module) -> dict[str, Tensor]:
        return {name: value.detach().clone().cpu() for name, value in module.state_dict().items()}

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.validations.append(
            {
                "step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "state": self._state(pl_module),
                "batches": [],
            }
        )

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, *args: Any
    ) -> None:
        if not trainer.sanity_checking:
            self.validations[-1]["batches"].append(_clone(batch))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.train_every is not None and trainer.global_step % self.train_every == 0:
            self.train.append({"step": trainer.global_step, "state": self._state(pl_module), "batch": _clone(batch)})


class WarningsToFile(pl.Callback):
    """Record every warning from setup to teardown and write their messages to ``{directory}/warnings_rank{r}.txt``.

    For runs in other processes (DDP), whose warnings the test process cannot catch.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._catching: Any = None
        self._caught: list[Any] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._catching = warnings.catch_warnings(record=True)
        self._caught = self._catching.__enter__()
        warnings.simplefilter("always")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._catching.__exit__(None, None, None)
        path = f"{self.directory}/warnings_rank{trainer.global_rank}.txt"
        with open(path, "w") as handle:
            handle.write("\n".join(str(w.message).replace("\n", " ") for w in self._caught))


class MemoryLogger(Logger):
    """A Lightning logger that keeps every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def merged_records(self) -> list[tuple[int | None, dict[str, float]]]:
        """``records``, consecutive calls at one step merged (Lightning and the monitor each write part of it)."""
        merged: list[tuple[int | None, dict[str, float]]] = []
        for step, metrics in self.records:
            if merged and merged[-1][0] == step:
                merged[-1][1].update(metrics)
            else:
                merged.append((step, dict(metrics)))
        return merged

    def steps_of(self, name: str) -> list[int | None]:
        """Steps at which ``name`` was logged, in order."""
        return [step for step, metrics in self.records if name in metrics]

    def values_of(self, name: str) -> list[float]:
        return [metrics[name] for _, metrics in self.records if name in metrics]
