"""An independent float64 reference for attention entropy and its support.

Nothing here imports attn_monitor. Everything is dense and written for
clarity, not speed: the support is built cell by cell from the rules in
docs/design.md §2 and §6, and each query's entropy is computed from its own list of
valid keys with Python floats (IEEE float64).

Rules implemented (the library must agree):

* key padding: a padding key is never visible; with Nq == Nk the padding mask
  also marks padding *queries*, which are not samples.
* causal (top-left aligned, also for Nq != Nk): query i sees key j iff j <= i.
* sliding window W (always causal): query i sees key j iff i - W < j <= i.
* packed documents: query i sees key j iff both belong to the same document.
* explicit bool mask: True = visible.
* all pieces combine by intersection.
* entropy: p = softmax / renormalised weights over the visible keys only,
  H = -sum p ln p with 0 ln 0 = 0; NaN when no key is visible.
* normalised entropy: H / ln n for n > 1; NaN for n <= 1.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "FAMILIES",
    "MaskSpec",
    "attention_entropy",
    "dense_support",
    "distance_from_qk",
    "entropy_from_qk",
    "entropy_from_scores",
    "head_means",
    "is_sample",
    "lse_from_qk",
    "make_spec",
    "max_logit_from_qk",
    "normalize",
    "num_valid",
    "query_is_real",
]


@dataclass
class MaskSpec:
    """A mask described by its pieces, the way a batch and a model state it.

    ``padding`` and ``documents`` are nested lists (batch, positions); ``explicit``
    is a bool tensor broadcastable to (batch, heads, Nq, Nk).
    """

    batch: int
    heads: int
    num_queries: int
    num_keys: int
    padding: list[list[bool]] | None = None
    causal: bool = False
    window: int | None = None
    documents: list[list[int]] | None = None
    explicit: Tensor | None = field(default=None, repr=False)


# --------------------------------------------------------------------------- support


def dense_support(spec: MaskSpec) -> Tensor:
    """(B, H, Nq, Nk) bool: True where query i of (b, h) may attend to key j."""
    explicit = None
    if spec.explicit is not None:
        shape = (spec.batch, spec.heads, spec.num_queries, spec.num_keys)
        explicit = spec.explicit.expand(shape).tolist()
    out = []
    for b in range(spec.batch):
        per_head = []
        for h in range(spec.heads):
            rows = []
            for i in range(spec.num_queries):
                row = []
                for j in range(spec.num_keys):
                    visible = True
                    if spec.padding is not None and not spec.padding[b][j]:
                        visible = False
                    if spec.causal and j > i:
                        visible = False
                    if spec.window is not None and j <= i - spec.window:
                        visible = False
                    if spec.documents is not None and spec.documents[b][i] != spec.documents[b][j]:
                        visible = False
                    if explicit is not None and not explicit[b][h][i][j]:
                        visible = False
                    row.append(visible)
                rows.append(row)
            per_head.append(rows)
        out.append(per_head)
    return torch.tensor(out, dtype=torch.bool).reshape(spec.batch, spec.heads, spec.num_queries, spec.num_keys)


def num_valid(support: Tensor) -> Tensor:
    """(B, H, Nq) long: visible keys per query, counted one by one."""
    batch, heads, num_q, _ = support.shape
    cells = support.tolist()
    counts = [[[sum(1 for v in cells[b][h][i] if v) for i in range(num_q)] for h in range(heads)] for b in range(batch)]
    return torch.tensor(counts, dtype=torch.long).reshape(batch, heads, num_q)


def query_is_real(spec: MaskSpec) -> Tensor:
    """(B, Nq) bool: False for padding queries (only defined when Nq == Nk)."""
    real = [[True] * spec.num_queries for _ in range(spec.batch)]
    if spec.padding is not None and spec.num_queries == spec.num_keys:
        real = [[bool(spec.padding[b][i]) for i in range(spec.num_queries)] for b in range(spec.batch)]
    return torch.tensor(real, dtype=torch.bool).reshape(spec.batch, spec.num_queries)


def is_sample(spec: MaskSpec) -> Tensor:
    """(B, H, Nq) bool: a real query with at least one visible key."""
    counts = num_valid(dense_support(spec)).tolist()
    real = query_is_real(spec).tolist()
    out = [
        [[counts[b][h][i] > 0 and real[b][i] for i in range(spec.num_queries)] for h in range(spec.heads)]
        for b in range(spec.batch)
    ]
    return torch.tensor(out, dtype=torch.bool).reshape(spec.batch, spec.heads, spec.num_queries)


# --------------------------------------------------------------------------- entropy


def _entropy_of_weights(weights: list[float]) -> float:
    """-sum p ln p of non-negative weights after renormalising them to sum 1."""
    if not weights:
        return math.nan
    total = math.fsum(weights)
    terms = []
    for w in weights:
        p = w / total
        if p > 0.0:
            terms.append(-p * math.log(p))
    return math.fsum(terms)


def _softmax_entropy(logits: list[float]) -> float:
    if not logits:
        return math.nan
    top = max(logits)
    return _entropy_of_weights([math.exp(s - top) for s in logits])


def _per_row(values: Tensor, support: Tensor, row_fn) -> Tensor:
    batch, heads, num_q, num_k = values.shape
    support = support.expand(values.shape)
    cells, visible = values.double().tolist(), support.tolist()
    out = [
        [
            [row_fn([cells[b][h][i][j] for j in range(num_k) if visible[b][h][i][j]]) for i in range(num_q)]
            for h in range(heads)
        ]
        for b in range(batch)
    ]
    return torch.tensor(out, dtype=torch.float64).reshape(batch, heads, num_q)


def attention_entropy(attn: Tensor, support: Tensor) -> Tensor:
    """(B, H, Nq) float64 entropy of ``attn`` restricted to ``support`` and renormalised."""
    return _per_row(attn, support, _entropy_of_weights)


def entropy_from_scores(scores: Tensor, support: Tensor) -> Tensor:
    """(B, H, Nq) float64 entropy of softmax(scores) over ``support``."""
    return _per_row(scores, support, _softmax_entropy)


def scores_from_qk(q: Tensor, k: Tensor, scale: float | None = None, bias: Tensor | None = None) -> Tensor:
    """(B, H, Nq, Nk) float64 logits; query head h uses key head h // (H // H_kv)."""
    q64, k64 = q.double(), k.double()
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    k64 = k64[:, [h // group for h in range(heads)]]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bhqd,bhkd->bhqk", q64, k64) * scale
    if bias is not None:
        scores = scores + bias.double()
    return scores


def entropy_from_qk(
    q: Tensor, k: Tensor, support: Tensor, scale: float | None = None, bias: Tensor | None = None
) -> Tensor:
    """(B, H, Nq) float64 entropy of softmax(scale q k^T + bias) over ``support``."""
    scores = scores_from_qk(q, k, scale, bias)
    # Hidden keys may carry -inf bias; they are dropped by the support before use.
    scores = torch.where(support.expand(scores.shape), scores, torch.zeros((), dtype=torch.float64))
    return entropy_from_scores(scores, support)


def _per_row_indexed(values: Tensor, support: Tensor, row_fn) -> Tensor:
    """Like ``_per_row``, but ``row_fn(i, [(j, value), ...])`` also sees the query and key positions."""
    batch, heads, num_q, num_k = values.shape
    support = support.expand(values.shape)
    cells, visible = values.double().tolist(), support.tolist()
    out = [
        [
            [row_fn(i, [(j, cells[b][h][i][j]) for j in range(num_k) if visible[b][h][i][j]]) for i in range(num_q)]
            for h in range(heads)
        ]
        for b in range(batch)
    ]
    return torch.tensor(out, dtype=torch.float64).reshape(batch, heads, num_q)


def max_logit_from_qk(
    q: Tensor, k: Tensor, support: Tensor, scale: float | None = None, bias: Tensor | None = None
) -> Tensor:
    """(B, H, Nq) float64: the largest logit over each query's visible keys; NaN when none is visible."""
    scores = scores_from_qk(q, k, scale, bias)
    return _per_row_indexed(scores, support, lambda i, row: max(s for _, s in row) if row else math.nan)


def _mean_distance(i: int, row: list[tuple[int, float]]) -> float:
    if not row:
        return math.nan
    top = max(s for _, s in row)
    weights = [(j, math.exp(s - top)) for j, s in row]
    total = math.fsum(w for _, w in weights)
    return math.fsum(w / total * abs(i - j) for j, w in weights)


def distance_from_qk(
    q: Tensor, k: Tensor, support: Tensor, scale: float | None = None, bias: Tensor | None = None
) -> Tensor:
    """(B, H, N) float64: E|i - j| under softmax(scale q k^T + bias) over the support; NaN when empty."""
    scores = scores_from_qk(q, k, scale, bias)
    return _per_row_indexed(scores, support, _mean_distance)


def normalize(entropy: Tensor, counts: Tensor) -> Tensor:
    """H / ln n per query; NaN for n <= 1 (and wherever H is NaN)."""
    counts = counts.expand(entropy.shape)
    flat, ns = entropy.double().reshape(-1).tolist(), counts.reshape(-1).tolist()
    out = [h / math.log(n) if n > 1 else math.nan for h, n in zip(flat, ns, strict=True)]
    return torch.tensor(out, dtype=torch.float64).reshape(entropy.shape)


# --------------------------------------------------------------------------- mask families

#: Mask families exercised by the tests; ``needs_square`` ones use documents.
FAMILIES: dict[str, bool] = {
    "none": False,
    "pad_right": False,
    "pad_left": False,
    "causal": False,
    "causal_pad_right": False,
    "causal_pad_left": False,
    "documents": True,
    "documents_pad": True,
    "documents_causal": True,
    "window": False,
    "window_pad_causal": False,
    "window_documents": True,
    "explicit": False,
    "explicit_pad": False,
    "explicit_causal": False,
    "one_valid": False,
    "fully_masked": False,
}


def _padding(batch: int, length: int, left: bool) -> list[list[bool]]:
    rows = []
    for b in range(batch):
        real = max(1, length - 1 - 2 * b)
        row = [True] * real + [False] * (length - real)
        rows.append(row[::-1] if left else row)
    return rows


def _documents(batch: int, length: int, rng: random.Random) -> list[list[int]]:
    rows = []
    for _ in range(batch):
        ids, used = [], set()
        while len(ids) < length:
            doc = rng.choice([d for d in range(20) if d not in used])
            used.add(doc)
            ids.extend([doc] * rng.randint(1, max(1, length // 2)))
        rows.append(ids[:length])
    return rows


def make_spec(family: str, batch: int, heads: int, num_queries: int, num_keys: int, seed: int) -> MaskSpec:
    """A mask of the named family for the given sizes, random parts drawn from ``seed``."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = MaskSpec(batch, heads, num_queries, num_keys)
    if family == "none":
        pass
    elif family in ("pad_right", "pad_left"):
        spec.padding = _padding(batch, num_keys, left=family == "pad_left")
    elif family == "causal":
        spec.causal = True
    elif family in ("causal_pad_right", "causal_pad_left"):
        spec.causal = True
        spec.padding = _padding(batch, num_keys, left=family == "causal_pad_left")
    elif family == "documents":
        spec.documents = _documents(batch, num_keys, rng)
    elif family == "documents_pad":
        spec.documents = _documents(batch, num_keys, rng)
        spec.padding = _padding(batch, num_keys, left=False)
    elif family == "documents_causal":
        spec.documents = _documents(batch, num_keys, rng)
        spec.causal = True
    elif family == "window":
        spec.causal, spec.window = True, 2
    elif family == "window_pad_causal":
        spec.causal, spec.window = True, 3
        spec.padding = _padding(batch, num_keys, left=True)
    elif family == "window_documents":
        spec.causal, spec.window = True, 3
        spec.documents = _documents(batch, num_keys, rng)
    elif family == "explicit":
        spec.explicit = torch.rand(batch, heads, num_queries, num_keys, generator=gen) < 0.6
    elif family == "explicit_pad":
        spec.explicit = torch.rand(1, heads, num_queries, num_keys, generator=gen) < 0.7
        spec.padding = _padding(batch, num_keys, left=False)
    elif family == "explicit_causal":
        spec.explicit = torch.rand(batch, 1, num_queries, num_keys, generator=gen) < 0.7
        spec.causal = True
    elif family == "one_valid":
        index = torch.randint(num_keys, (batch, heads, num_queries, 1), generator=gen)
        explicit = torch.zeros(batch, heads, num_queries, num_keys, dtype=torch.bool)
        spec.explicit = explicit.scatter(-1, index, True)
    elif family == "fully_masked":
        explicit = torch.rand(batch, 1, num_queries, num_keys, generator=gen) < 0.7
        explicit[:, :, ::2] = False  # every other query sees nothing
        spec.explicit = explicit
    else:
        raise KeyError(family)
    return spec


# --------------------------------------------------------------------------- per-head pooling


def head_means(probs: Tensor, visible: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
    """Token-weighted mean normalised entropy per head, and the number of queries it pools.

    Args:
        probs: (B, H, Nq, Nk) attention weights; values off the support are ignored.
        visible: bool broadcastable to ``probs``: the support the model's documented mask implies.
        real: (B, Nq) bool: queries that are real tokens of their own sequence.

    Returns:
        ((H,) float64 means, (H,) long counts) over real queries with more than one visible key.
    """
    probs = probs.to(torch.float64)
    visible = visible.expand(probs.shape)
    weights = torch.where(visible, probs, torch.zeros((), dtype=torch.float64))
    p = weights / weights.sum(-1, keepdim=True).clamp(min=1e-300)
    entropy = -torch.where(p > 0, p * p.log(), torch.zeros((), dtype=torch.float64)).sum(-1)
    n = visible.sum(-1)
    counted = real[:, None, :].expand(n.shape) & (n > 1)
    normalised = torch.where(counted, entropy / n.clamp(min=2).to(torch.float64).log(), 0.0)
    counts = counted.sum((0, 2))
    return normalised.sum((0, 2)) / counts.clamp(min=1).to(torch.float64), counts


def lse_from_qk(q: Tensor, k: Tensor, support: Tensor, scale: float | None = None) -> Tensor:
    """(B, H, Nq) float64 logsumexp of the visible logits, term by term; -inf when none is visible."""

    def lse(_: int, row: list[tuple[int, float]]) -> float:
        if not row:
            return -math.inf
        top = max(s for _, s in row)
        return top + math.log(math.fsum(math.exp(s - top) for _, s in row))

    return _per_row_indexed(scores_from_qk(q, k, scale), support, lse)
