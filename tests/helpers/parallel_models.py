"""A tiny Llama-style model for the parallelism tests, its data, and a float64 reference built from its weights.

The model has what tensor-parallel plans are written for: separate q, k, v
and o projections and one SDPA call per layer, heads from ``view(..., -1,
head_dim)`` so a rank with half the projection rows runs half the heads.
The reference never uses attn_monitor: it records each attention module's
input, rebuilds q and k from the unsharded weights in float64 and takes the
dense softmax of ``tests/reference.py``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.helpers import reference

HIDDEN, HEADS, LAYERS, VOCAB, SEQ = 16, 4, 2, 32, 6
HEAD_DIM = HIDDEN // HEADS
INIT_STD = 1.0  # large: attention far from uniform


class LlamaStyleAttention(nn.Module):
    """Separate q/k/v/o projections and one causal SDPA call; heads follow the projections' local rows."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = HEAD_DIM
        self.config = SimpleNamespace(num_attention_heads=HEADS)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for proj in self.projections())
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.q_proj, self.k_proj, self.v_proj


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.attn = LlamaStyleAttention()
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.SiLU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


class TinyLlama(nn.Module):
    """Embedding, ``LAYERS`` blocks in a ModuleDict (as pipeline stages keep names), a head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleDict({str(index): Block() for index in range(LAYERS)})
        self.head = nn.Linear(HIDDEN, VOCAB)
        for name, parameter in self.named_parameters():
            if "proj" in name:
                nn.init.normal_(parameter, std=INIT_STD)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.layers.values():
            x = block(x)
        return self.head(x)


def tp_plan() -> dict[str, object]:
    """The standard plan: ColwiseParallel on q, k and v, RowwiseParallel on o."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, object] = {}
    for index in range(LAYERS):
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"layers.{index}.attn.{name}"] = ColwiseParallel()
        plan[f"layers.{index}.attn.o_proj"] = RowwiseParallel()
    return plan


def batches() -> list[tuple[Tensor, Tensor]]:
    """Two (tokens, padding mask) batches of (2, SEQ); the second has right padding."""
    generator = torch.Generator().manual_seed(7)
    tokens = [torch.randint(VOCAB, (2, SEQ), generator=generator) for _ in range(2)]
    full = torch.ones(2, SEQ, dtype=torch.bool)
    padded = torch.tensor([[True] * SEQ, [True] * 4 + [False] * (SEQ - 4)])
    return [(tokens[0], full), (tokens[1], padded)]


def layer_names() -> list[str]:
    return [f"layers.{index}.attn" for index in range(LAYERS)]


def reference_statistics(model: TinyLlama, data: list[tuple[Tensor, Tensor]]) -> dict[str, dict[str, Tensor]]:
    """Per layer: (HEADS,) mean normalised entropy, counted queries, max logit; float64, dense, from the weights.

    Entropy counts real queries with more than one visible key; the max
    logit every real query (each sees at least itself under the causal mask).
    """
    inputs: dict[str, list[Tensor]] = {name: [] for name in layer_names()}
    handles = [
        model.get_submodule(name).register_forward_pre_hook(lambda _, args, name=name: inputs[name].append(args[0]))
        for name in layer_names()
    ]
    try:
        with torch.no_grad():
            for tokens, _ in data:
                model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    visible = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()[None, None]
    out = {}
    for name in layer_names():
        attention = model.get_submodule(name)
        w_q, w_k = attention.q_proj.weight.double(), attention.k_proj.weight.double()
        sums, counts = torch.zeros(HEADS, dtype=torch.float64), torch.zeros(HEADS)
        peaks = torch.full((HEADS,), -math.inf, dtype=torch.float64)
        entropies = []
        for x, (_, real) in zip(inputs[name], data, strict=True):
            q, k = ((x.double() @ w.T).view(x.shape[0], SEQ, HEADS, HEAD_DIM).transpose(1, 2) for w in (w_q, w_k))
            entropy = reference.normalize(reference.entropy_from_qk(q, k, visible), reference.num_valid(visible))
            counted = real[:, None, :] & (reference.num_valid(visible) > 1)
            sums += torch.where(counted, entropy, 0.0).sum((0, 2))
            counts += counted.sum((0, 2))
            entropies.append(entropy[counted.expand(entropy.shape)])
            logits = reference.max_logit_from_qk(q, k, visible).masked_fill(~real[:, None, :], -math.inf)
            peaks = torch.maximum(peaks, logits.amax((0, 2)))
        assert torch.cat(entropies).std() > 0.1, "the reference must be spread, or the tests prove little"
        out[name] = {"mean": sums / counts, "count": counts, "max_logit": peaks}
    return out


class ParallelLM(pl.LightningModule):
    """:class:`TinyLlama` under Lightning's ModelParallelStrategy: the standard plan on the tensor-parallel
    mesh, FSDP2 over the data-parallel one, each where it has more than one rank.

    lr 0: the weights stay the initial ones, so a reference on a fresh model is the monitored model.
    """

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyLlama()

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        if self.device_mesh["tensor_parallel"].size() > 1:
            parallelize_module(self.model, self.device_mesh["tensor_parallel"], tp_plan())  # type: ignore[arg-type]
        if self.device_mesh["data_parallel"].size() > 1:
            for block in self.model.layers.values():
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.model(batch["input_ids"])
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["input_ids"][:, 1:].reshape(-1))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def items() -> list[dict[str, Tensor]]:
    """:func:`batches` as the dict items of a ``batch_size=None`` loader."""
    return [{"input_ids": tokens, "attention_mask": real.long()} for tokens, real in batches()]
