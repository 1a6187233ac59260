"""Per-head max logit and mean attention distance: metric, consumer, alerts and callback.

Every check is against an independent float64 reference (tests/reference.py and
the loops below, nothing from attn_monitor): per-query max logits and
distances recomputed from q and k (or from the probabilities) over the true
support, then maximised or averaged over the counted queries (real queries of
the call's own sequence with a visible key) in plain Python.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from attn_monitor import Batches, LogOptions, MaxLogitAlert, OverloadAlert, Statistics
from attn_monitor.capture.calls import AttentionCall
from attn_monitor.capture.consumers import StatisticsUpdate
from attn_monitor.capture.evaluate import evaluate_attention
from attn_monitor.capture.hooks import AttentionCapture
from attn_monitor.functional.masks import Support
from attn_monitor.functional.statistics import distance_from_probs
from attn_monitor.lightning.callback import AttentionEntropyMonitor
from attn_monitor.metrics.entropy import AttentionEntropy
from attn_monitor.metrics.statistics import AttentionStatistics
from tests.capture.test_diagnostics import llama_qk
from tests.helpers import lightning_models as lm
from tests.helpers import models, reference
from tests.lightning.test_callback import make_trainer, read_tensorboard, tb_scalars_at

TOL = 1e-4


# --------------------------------------------------------------------------- reference


class Pooled:
    """Counted per-query values of one layer, per head, pooled over calls."""

    def __init__(self, heads: int) -> None:
        self.logits: list[list[float]] = [[] for _ in range(heads)]
        self.distances: list[list[float]] = [[] for _ in range(heads)]

    def add(self, max_logit: Tensor | None, distance: Tensor | None, counted: Tensor) -> None:
        batch, heads, num_q = counted.shape
        for b in range(batch):
            for h in range(heads):
                for i in range(num_q):
                    if not counted[b, h, i]:
                        continue
                    if max_logit is not None:
                        self.logits[h].append(float(max_logit[b, h, i]))
                    if distance is not None:
                        self.distances[h].append(float(distance[b, h, i]))

    def head_max(self) -> list[float]:
        return [max(values) if values else math.nan for values in self.logits]

    def head_mean(self) -> list[float]:
        return [math.fsum(values) / len(values) if values else math.nan for values in self.distances]

    def layer_mean(self) -> float:
        values = [v for head in self.distances for v in head]
        return math.fsum(values) / len(values)


def ref_distance_from_probs(probs: Tensor, support: Tensor) -> Tensor:
    """(B, H, N) float64 E|i - j| of weights renormalised on the support, row by row; NaN without mass."""
    batch, heads, num_q, num_k = probs.shape
    support = support.expand(probs.shape)
    out = torch.full((batch, heads, num_q), math.nan, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(num_q):
                row = [(j, float(probs[b, h, i, j])) for j in range(num_k) if support[b, h, i, j]]
                total = math.fsum(w for _, w in row)
                if row and total > 0:
                    out[b, h, i] = math.fsum(w / total * abs(i - j) for j, w in row)
    return out


def check_summary(summary: Any, expected: dict[str, Pooled], *, logits: bool = True) -> None:
    assert summary.layers == list(expected)
    for index, (layer, pooled) in enumerate(expected.items()):
        heads = len(pooled.distances)
        got_mean = summary.distance[index, :heads].tolist()
        assert got_mean == pytest.approx(pooled.head_mean(), abs=TOL, rel=TOL), layer
        assert float(summary.layer_distance[index]) == pytest.approx(pooled.layer_mean(), abs=TOL, rel=TOL)
        assert summary.distance_count[index, :heads].tolist() == [len(v) for v in pooled.distances]
        if logits:
            assert summary.max_logit[index, :heads].tolist() == pytest.approx(pooled.head_max(), rel=TOL, abs=TOL)
            assert float(summary.layer_max_logit[index]) == pytest.approx(max(pooled.head_max()), rel=TOL, abs=TOL)
        else:
            assert summary.logit_count[index].sum() == 0 and math.isnan(summary.layer_max_logit[index])


def assert_spread(expected: dict[str, Pooled]) -> None:
    """The reference tells heads apart: a query counted wrongly or a wrong mask moves it past the tolerance."""
    for pooled in expected.values():
        means = pooled.head_mean()
        assert max(means) - min(means) > 0.05, means
        assert max(pooled.layer_mean() - m for m in means) > 0.01


# --------------------------------------------------------------------------- the metric


def _random_call(seed: int, batch: int, heads: int = 3, queries: int = 7) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, heads, queries, generator=generator, dtype=torch.float64) * 50
    distance = torch.rand(batch, heads, queries, generator=generator, dtype=torch.float64) * 20
    sample = torch.rand(batch, 1, queries, generator=generator) > 0.3
    return logits, distance, sample


@pytest.mark.filterwarnings("ignore:The ``compute`` method")
def test_streaming_updates_equal_the_reference_on_the_concatenated_data() -> None:
    calls = [_random_call(seed, batch) for seed, batch in enumerate([2, 1, 3, 2])]
    calls[1][0][0, 2, 4] = math.inf  # a diverging query: left out of the max, counted
    calls[1][2][0, 0, 4] = True
    calls[2][1][2, 0, 1] = math.nan
    calls[2][2][2, 0, 1] = True
    calls[2][1][1, :, ~calls[2][2][1, 0]] = math.nan  # NaN distances outside the samples are ignored
    metric = AttentionStatistics()
    for logits, distance, sample in calls:
        metric.update("layer.0", max_logit=logits.float(), distance=distance.float(), is_sample=sample)
    metric.update("layer.1", distance=calls[0][1].float())  # distance only (a probabilities layer)
    summary = metric.compute()

    pooled = Pooled(3)
    nonfinite = torch.zeros(2, 3)
    for logits, distance, sample in calls:
        counted = sample.expand_as(logits)
        for name, values in enumerate((logits, distance)):
            bad = counted & ~torch.isfinite(values)
            nonfinite[name] += bad.sum((0, 2))
        pooled.add(
            logits.masked_fill(~torch.isfinite(logits), -math.inf),
            None,
            counted & torch.isfinite(logits),
        )
        pooled.add(None, distance, counted & torch.isfinite(distance))
    assert summary.max_logit[0].tolist() == pytest.approx(pooled.head_max(), rel=1e-6)
    assert summary.distance[0].tolist() == pytest.approx(pooled.head_mean(), rel=1e-6)
    assert summary.logit_nonfinite[0].tolist() == nonfinite[0].tolist()
    assert summary.distance_nonfinite[0].tolist() == nonfinite[1].tolist()
    assert summary.logit_count[1].tolist() == [0, 0, 0] and summary.max_logit[1].isnan().all()
    assert summary.distance_count[1].tolist() == [14, 14, 14]

    scalars = summary.to_dict()
    assert scalars["attn_max_logit/layer.0/max"] == pytest.approx(max(pooled.head_max()), rel=1e-6)
    assert scalars["attn_distance/layer.0/mean"] == pytest.approx(pooled.layer_mean(), rel=1e-6)
    assert scalars["attn_max_logit/layer.0/nonfinite"] == 1.0
    assert scalars["attn_distance/layer.0/nonfinite"] == 1.0
    for head in range(3):
        assert scalars[f"attn_max_logit_heads/layer.0/head_{head}/max"] == pytest.approx(pooled.head_max()[head])
        assert scalars[f"attn_distance_heads/layer.0/head_{head}/mean"] == pytest.approx(pooled.head_mean()[head])
    assert "attn_max_logit/layer.1/max" not in scalars and "attn_distance/layer.1/mean" in scalars
    assert all(type(value) is float for value in scalars.values())
    assert not any("_heads/" in name for name in summary.to_dict(per_head=False))

    metric.reset()
    assert metric.layers == ["layer.0", "layer.1"] and metric.compute().distance_count.sum() == 0


def test_merge_takes_the_max_and_adds_the_sums() -> None:
    """Merged metrics equal the plain-Python pool of both calls' counted queries (max, mean, counts).

    Layer "x" is in both metrics, "y" and "z" in one each. Fails when the
    merge adds the max fields or keeps either side's maximum alone.
    """
    calls = {"left": [("x", _random_call(1, 2)), ("y", _random_call(3, 1))], "right": [("x", _random_call(2, 3))]}
    calls["right"].append(("z", _random_call(4, 2)))
    metrics = {side: AttentionStatistics() for side in calls}
    expected = {layer: Pooled(3) for layer in ("x", "y", "z")}
    x_alone = {side: Pooled(3) for side in calls}
    for side, side_calls in calls.items():
        for layer, (logits, distance, sample) in side_calls:
            metrics[side].update(layer, max_logit=logits, distance=distance, is_sample=sample)
            for pooled in [expected[layer]] + ([x_alone[side]] if layer == "x" else []):
                pooled.add(logits, distance, sample.expand_as(logits))
    # Per head, a sum of the two maxima or one side's maximum alone is not the maximum of the union.
    pairs = zip(x_alone["left"].head_max(), x_alone["right"].head_max(), strict=True)
    assert all(a != b and min(a, b) != 0 for a, b in pairs)
    metrics["left"].merge_state(metrics["right"])
    summary = metrics["left"].compute()
    assert summary.layers == ["x", "y", "z"]
    for index, (layer, pooled) in enumerate(expected.items()):
        assert summary.max_logit[index].tolist() == pooled.head_max(), layer  # a maximum is one of the values
        assert summary.distance[index].tolist() == pytest.approx(pooled.head_mean(), rel=1e-12), layer
        assert summary.logit_count[index].tolist() == [len(values) for values in pooled.logits], layer
        assert summary.distance_count[index].tolist() == [len(values) for values in pooled.distances], layer


def test_metric_rejects_bad_input() -> None:
    metric = AttentionStatistics()
    with pytest.raises(TypeError, match="max_logit"):
        metric.update("x", max_logit=torch.ones(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="3 dims"):
        metric.update("x", distance=torch.ones(2, 3))
    with pytest.raises(ValueError, match="one shape"):
        metric.update("x", max_logit=torch.ones(1, 2, 3), distance=torch.ones(1, 2, 4))
    with pytest.raises(ValueError, match=">= 0"):
        metric.update("x", distance=-torch.ones(1, 2, 3))
    with pytest.raises(ValueError, match="is_sample"):
        metric.update("x", distance=torch.ones(1, 2, 3), is_sample=torch.ones(1, 2, 5, dtype=torch.bool))
    # A negative distance on a query that is not a sample is ignored, not an error.
    metric.update("x", distance=torch.tensor([[[-1.0, 2.0]]]), is_sample=torch.tensor([False, True]))
    assert metric.compute().distance.tolist() == [[2.0]]


# --------------------------------------------------------------------------- distance from probabilities


@pytest.mark.parametrize("case", ["causal", "padding", "empty rows", "no mass"])
def test_distance_from_probs_matches_reference(case: str) -> None:
    generator = torch.Generator().manual_seed(3)
    batch, heads, length = 2, 3, 9
    probs = torch.rand(batch, heads, length, length, generator=generator).pow(4)
    probs = probs / probs.sum(-1, keepdim=True)
    padding = [[True] * length, [False, False] + [True] * (length - 2)]
    spec = reference.MaskSpec(batch, heads, length, length, causal=case != "padding", padding=padding)
    support = reference.dense_support(spec)
    if case == "empty rows":
        support[1, :, 3:5] = False
    if case == "no mass":
        probs[0, 1, 4] = torch.where(support[0, 1, 4], 0.0, probs[0, 1, 4])
    want = ref_distance_from_probs(probs.double(), support)
    got = distance_from_probs(probs, support)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.allclose(got[~want.isnan()].double(), want[~want.isnan()], atol=1e-5)
    assert want.isnan().any() == (case != "padding")  # causal order leaves the padded first queries no key


def test_distance_from_probs_needs_square_weights() -> None:
    with pytest.raises(ValueError, match="square"):
        distance_from_probs(torch.full((1, 1, 2, 3), 1 / 3))


# --------------------------------------------------------------------------- the consumer on real models


def tiny_gpt_reference(state: dict[str, Tensor], batches: list[dict[str, Tensor]]) -> dict[str, Pooled]:
    """Per-layer counted values of :class:`TinyGPT` with ``state``, recomputed in float64 from its own projections."""
    model = lm.TinyGPT()
    model.load_state_dict(state)
    model = model.double().eval()
    out = {name: Pooled(lm.HEADS) for name in lm.GPT_LAYERS}
    with torch.no_grad():
        for batch in batches:
            ids, real = batch["input_ids"], batch["attention_mask"].bool()
            b, n = ids.shape
            support = reference.dense_support(reference.MaskSpec(b, lm.HEADS, n, n, padding=real.tolist(), causal=True))
            counted = real[:, None, :].expand(b, lm.HEADS, n) & (reference.num_valid(support) > 0)
            x = model.embed(ids)
            for name, block in zip(lm.GPT_LAYERS, model.blocks, strict=True):
                q, k, v = block.attn.qkv(block.ln_1(x))
                out[name].add(
                    reference.max_logit_from_qk(q, k, support), reference.distance_from_qk(q, k, support), counted
                )
                scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~support, -math.inf)
                y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(x.shape)
                x = x + block.attn.c_proj(y)
                x = x + block.mlp(block.ln_2(x))
    return out


def test_sdpa_model_through_evaluate_attention_matches_reference() -> None:
    """nanoGPT-style SDPA with a causal AND key-padding bool mask, right and left padding, from evaluate_attention."""
    torch.manual_seed(0)
    model = lm.TinyGPT()
    with torch.no_grad():
        for block in model.blocks:
            models.sharpen(block.attn.c_attn.weight, lm.HIDDEN, 3.0)
    right, left = lm.make_batches(2, seed=5)
    # Left padding too: the hidden keys then precede the real queries, in reach of any mask that ignores padding.
    lengths = left["attention_mask"].sum(-1)
    left = {
        name: torch.stack([row.roll(row.shape[-1] - int(n)) for row, n in zip(value, lengths, strict=True)])
        for name, value in left.items()
    }
    # Each layout alone and both together: a maximum pooled over many queries hides one wrong query.
    for batches in ([right], [left], [right, left]):
        update = StatisticsUpdate()
        evaluate_attention(model, batches, consumers=[update])
        expected = tiny_gpt_reference(model.state_dict(), batches)
        assert_spread(expected)
        check_summary(update.metric.compute(), expected)


def _llama_batch() -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(9)
    ids = torch.randint(1, models.VOCAB, (3, 12), generator=generator)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    mask[2, :2] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def _llama_reference(seen: list[tuple[Tensor, Tensor, float]], batch: dict[str, Tensor]) -> dict[str, Pooled]:
    real = batch["attention_mask"].bool()
    b, n = real.shape
    out = {}
    for index, (q, k, scale) in enumerate(seen):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # grouped-query keys
        heads = q.shape[1]
        support = reference.dense_support(reference.MaskSpec(b, heads, n, n, padding=real.tolist(), causal=True))
        counted = real[:, None, :].expand(b, heads, n) & (reference.num_valid(support) > 0)
        pooled = Pooled(heads)
        pooled.add(
            reference.max_logit_from_qk(q, k, support, scale), reference.distance_from_qk(q, k, support, scale), counted
        )
        out[f"model.layers.{index}.self_attn"] = pooled
    return out


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_hf_llama_matches_reference(implementation: str) -> None:
    """Tiny random Llama (grouped-query keys), left padding: both paths give max logit and distance.

    Eager attention is read from its softmax's logits, so it has a max logit too (and no warning says
    otherwise); reading only its returned probabilities fails the max-logit check.
    """
    model = models.hf_model("llama", implementation)
    batch = _llama_batch()
    update = StatisticsUpdate()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with llama_qk(model) as seen, AttentionCapture(model) as capture, torch.no_grad():
            for _ in range(2):  # the warning is given once per layer, not per call
                with capture.recording(batch["attention_mask"], consumers=[update]):
                    model(**batch)
    expected = _llama_reference(seen[:2], batch)
    for index, pooled in enumerate(_llama_reference(seen[2:], batch).values()):
        layer = expected[f"model.layers.{index}.self_attn"]
        layer.logits = [a + b for a, b in zip(layer.logits, pooled.logits, strict=True)]
        layer.distances = [a + b for a, b in zip(layer.distances, pooled.distances, strict=True)]
    assert_spread(expected)
    check_summary(update.metric.compute(), expected, logits=True)
    assert [str(w.message) for w in caught if "max logit cannot be measured" in str(w.message)] == []


def test_rows_without_mass_are_left_out_not_counted_as_nonfinite() -> None:
    """Eager weights after dropout can lose a row's whole support: left out as for entropy, not a divergence."""
    probs = torch.full((1, 2, 4, 4), 0.25)
    probs[0, 1, 2] = torch.tensor([0.0, 0.0, 0.0, 1.0])  # all of it on a key causal order hides
    call = AttentionCall("eager.attn", Support(4, 4, causal=True), probs=probs)
    update = StatisticsUpdate(max_logit=False)
    update(call, torch.ones(1, 1, 4, dtype=torch.bool))
    summary = update.metric.compute()
    assert summary.distance_count.tolist() == [[4.0, 3.0]]
    assert summary.distance_nonfinite.sum() == 0
    want = [ref_distance_from_probs(probs.double(), torch.ones(4, 4, dtype=torch.bool).tril())[0, h] for h in (0, 1)]
    assert summary.distance[0].tolist() == pytest.approx([float(w.nanmean()) for w in want])


def test_cross_attention_gets_no_distance() -> None:
    attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    update = StatisticsUpdate()
    query, memory = torch.randn(1, 3, 8), torch.randn(1, 5, 8)
    capture = AttentionCapture(attn)
    with pytest.warns(UserWarning, match="not self-attention"), capture, capture.recording(consumers=[update]):
        attn(query, memory, memory, need_weights=False)
    summary = update.metric.compute()
    assert summary.distance_count.sum() == 0 and summary.logit_count.sum() == 6


# --------------------------------------------------------------------------- alerts


def _entropy_summary(medians: list[list[float]]) -> Any:
    metric = AttentionEntropy(num_bins=100)
    for index, heads in enumerate(medians):
        values = torch.tensor(heads, dtype=torch.float64)[None, :, None].expand(1, len(heads), 4)
        metric.update(f"blocks.{index}.attn", values * math.log(8.0), torch.tensor(8))
    return metric.compute()


def _logit_summary(peaks: list[list[float]]) -> Any:
    metric = AttentionStatistics()
    for index, heads in enumerate(peaks):
        metric.update(f"blocks.{index}.attn", max_logit=torch.tensor(heads)[None, :, None].expand(2, len(heads), 3))
    metric.update("probs.attn", distance=torch.ones(1, 2, 3))  # no max logit: no count logged
    return metric.compute()


def _run_alert(alert: Any, summaries: list[Any]) -> tuple[list[dict[str, float]], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logged = [alert(summary) for summary in summaries]
    return logged, [str(w.message) for w in caught]


def test_overload_alert_warns_once_per_head_and_counts() -> None:
    alert = OverloadAlert(threshold=0.97)
    first = _entropy_summary([[0.99, 0.5, 0.98], [0.2, 0.3, 0.4]])
    later = _entropy_summary([[0.99, 0.995, 0.5], [0.2, 0.3, 0.4]])
    logged, messages = _run_alert(alert, [first, first, later])
    assert logged == [
        {"attn_entropy/blocks.0.attn/overloaded_heads": 2.0, "attn_entropy/blocks.1.attn/overloaded_heads": 0.0},
        {"attn_entropy/blocks.0.attn/overloaded_heads": 2.0, "attn_entropy/blocks.1.attn/overloaded_heads": 0.0},
        {"attn_entropy/blocks.0.attn/overloaded_heads": 2.0, "attn_entropy/blocks.1.attn/overloaded_heads": 0.0},
    ]
    assert len(messages) == 2
    assert "'blocks.0.attn', heads [0, 2]" in messages[0] and "'blocks.0.attn', heads [1]" in messages[1]
    assert OverloadAlert()(first) == {}


def test_max_logit_alert_warns_once_per_head_and_counts() -> None:
    alert = MaxLogitAlert(threshold=100)
    first = _logit_summary([[120.0, 3.0], [99.0, 100.5]])
    later = _logit_summary([[150.0, 101.0], [99.0, 100.5]])
    logged, messages = _run_alert(alert, [first, later, later])
    for scalars in logged:
        assert set(scalars) == {f"attn_max_logit/blocks.{i}.attn/over_threshold_heads" for i in range(2)}
    assert [s["attn_max_logit/blocks.0.attn/over_threshold_heads"] for s in logged] == [1.0, 2.0, 2.0]
    assert [s["attn_max_logit/blocks.1.attn/over_threshold_heads"] for s in logged] == [1.0, 1.0, 1.0]
    assert len(messages) == 3
    assert "'blocks.0.attn', heads [0]" in messages[0] and "'blocks.1.attn', heads [1]" in messages[1]
    assert "'blocks.0.attn', heads [1]" in messages[2] and "[101.0]" in messages[2]


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (lambda: Statistics(max_logit=1), TypeError, "`max_logit`"),  # type: ignore[arg-type]
        (lambda: Statistics(distance="yes"), TypeError, "`distance`"),  # type: ignore[arg-type]
        (
            lambda: AttentionEntropyMonitor(alerts=[MaxLogitAlert(100.0)]),
            ValueError,
            "needs `Statistics\\(max_logit=True\\)`",
        ),
        (lambda: MaxLogitAlert("100"), TypeError, "`threshold` of MaxLogitAlert"),  # type: ignore[arg-type]
        (lambda: OverloadAlert(1.5), ValueError, "`threshold` of OverloadAlert"),
    ],
)
def test_callback_rejects_bad_arguments(options: Callable[[], object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        options()


# --------------------------------------------------------------------------- the callback in a real fit


def test_fit_logs_statistics_to_tensorboard_per_dataloader(tmp_path: Path) -> None:
    """Two validation dataloaders: every name gets ``/dataloader_idx_{i}``; values equal the reference."""
    logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = AttentionEntropyMonitor(
        statistics=Statistics(max_logit=True, distance=True),
        log=LogOptions(histogram_bins=None, per_head=True),  # each head's max logit is checked
        alerts=[OverloadAlert(0.0), MaxLogitAlert(0.0)],
    )
    recorder = lm.BatchRecorder()
    trainer = make_trainer(tmp_path, loggers=[logger], callbacks=[monitor, recorder], max_epochs=1)
    validation = [lm.loader(lm.make_batches(3, seed=6)), lm.loader(lm.make_batches(3, seed=7))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lm.TinyGPT(), lm.loader(lm.make_batches(2, seed=1)), validation)
    accumulator = read_tensorboard(logger.log_dir)
    step = recorder.validations[0]["step"] - 1  # Lightning logs validation metrics at the last stepped batch
    state, batches = recorder.validations[0]["state"], recorder.validations[0]["batches"]
    for index, (first, last) in enumerate([(0, 2), (3, 5)]):
        expected = tiny_gpt_reference(state, batches[first:last])
        suffix = f"/dataloader_idx_{index}"
        scalars = {}
        for family in ("attn_max_logit", "attn_max_logit_heads", "attn_distance", "attn_distance_heads"):
            scalars.update(tb_scalars_at(accumulator, step, family))
        names = {name for name in scalars}
        want = set()
        for layer, pooled in expected.items():
            want |= {f"attn_max_logit/{layer}/max{suffix}", f"attn_distance/{layer}/mean{suffix}"}
            want |= {f"attn_max_logit/{layer}/over_threshold_heads{suffix}"}
            for head in range(lm.HEADS):
                want |= {f"attn_max_logit_heads/{layer}/head_{head}/max{suffix}"}
                want |= {f"attn_distance_heads/{layer}/head_{head}/mean{suffix}"}
                assert scalars[f"attn_max_logit_heads/{layer}/head_{head}/max{suffix}"] == pytest.approx(
                    pooled.head_max()[head], rel=TOL, abs=TOL
                )
                assert scalars[f"attn_distance_heads/{layer}/head_{head}/mean{suffix}"] == pytest.approx(
                    pooled.head_mean()[head], rel=TOL, abs=TOL
                )
            assert scalars[f"attn_distance/{layer}/mean{suffix}"] == pytest.approx(pooled.layer_mean(), rel=TOL)
            assert scalars[f"attn_max_logit/{layer}/max{suffix}"] == pytest.approx(max(pooled.head_max()), rel=TOL)
            assert scalars[f"attn_max_logit/{layer}/over_threshold_heads{suffix}"] == lm.HEADS
        assert want <= names
        overloaded = tb_scalars_at(accumulator, step, "attn_entropy")
        for layer in lm.GPT_LAYERS:
            assert overloaded[f"attn_entropy/{layer}/overloaded_heads{suffix}"] == lm.HEADS
    messages = [str(w.message) for w in caught]
    # Once per head and dataloader, one warning per layer; training goes on.
    assert sum("large attention logits" in m for m in messages) == 2 * len(lm.GPT_LAYERS)
    assert sum("near-uniform attention" in m for m in messages) == 2 * len(lm.GPT_LAYERS)
    assert not trainer.should_stop
    assert set(monitor.last_statistics) == {0, 1}


def test_training_steps_get_no_statistics(tmp_path: Path) -> None:
    memory = lm.MemoryLogger()
    monitor = AttentionEntropyMonitor(
        batches=Batches(train_every_n_steps=1),
        statistics=Statistics(distance=True),
        log=LogOptions(histogram_bins=None, heatmap=False),
    )
    trainer = make_trainer(tmp_path, loggers=[memory], callbacks=[monitor], max_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(lm.TinyGPT(), lm.loader(lm.make_batches(2, seed=1)), lm.loader(lm.make_batches(1, seed=2)))
    logged = {name for _, metrics in memory.records for name in metrics}
    assert any(name.startswith("attn_entropy_train/") for name in logged)
    assert {name for name in logged if name.startswith("attn_distance/")} == {
        f"attn_distance/{layer}/mean" for layer in lm.GPT_LAYERS
    }
    assert not any(name.startswith("attn_max_logit") for name in logged)
    assert len(memory.steps_of(f"attn_distance/{lm.GPT_LAYERS[0]}/mean")) == 1
    assert monitor.core.recorder.streams["train"].statistics is None  # not computed either


# --------------------------------------------------------------------------- QK-Clip dry run


def test_clip_dry_run_matches_the_reference_factors() -> None:
    """Per head min(1, tau / max logit) and per layer the heads above tau, from the float64 reference max logits.

    tau sits between the heads' reference maxima, so some heads clip and some do not; the test fails when
    the factor is inverted (max / tau), when heads at tau count as clipped, or when heads with no counted
    query count (checked by breaking each, then restoring).
    """
    torch.manual_seed(0)
    model = lm.TinyGPT()
    with torch.no_grad():
        for block in model.blocks:
            models.sharpen(block.attn.c_attn.weight, lm.HIDDEN, 3.0)
    batches = list(lm.make_batches(2, seed=5))
    update = StatisticsUpdate(distance=False)
    evaluate_attention(model, batches, consumers=[update])
    summary = update.metric.compute()
    expected = {layer: pooled.head_max() for layer, pooled in tiny_gpt_reference(model.state_dict(), batches).items()}
    maxima = sorted(value for values in expected.values() for value in values)
    tau = (maxima[len(maxima) // 2 - 1] + maxima[len(maxima) // 2]) / 2
    assert maxima[0] < tau < maxima[-1] and maxima[-1] / tau > 1.05, maxima
    names = summary.to_dict(clip_threshold=tau)
    for index, (layer, head_max) in enumerate(expected.items()):
        factors = [min(1.0, tau / value) for value in head_max]
        assert summary.clip_factors(tau)[index, : len(factors)].tolist() == pytest.approx(factors, rel=TOL)
        clipped = sum(value > tau for value in head_max)
        assert float(summary.clipped_heads(tau)[index]) == clipped
        assert names[f"attn_qk_clip/{layer}/clipped_heads"] == clipped
        for head, factor in enumerate(factors):
            assert names[f"attn_qk_clip_heads/{layer}/head_{head}/factor"] == pytest.approx(factor, rel=TOL)
    assert "attn_qk_clip/" not in " ".join(summary.to_dict())  # off unless a threshold is given


def test_clip_dry_run_is_exact_over_head_shards_and_merges() -> None:
    """Heads split over two ranks at their global offsets, and batches split over two metrics, give the
    factors of one metric that saw everything; a layer or head with nothing counted has NaN, never 1."""
    logits, _, sample = _random_call(3, batch=4, heads=4)
    whole = AttentionStatistics()
    whole.update("layer.0", max_logit=logits, is_sample=sample)
    shards = [AttentionStatistics(), AttentionStatistics()]
    shards[0].update("layer.0", max_logit=logits[:2, :2], is_sample=sample[:2], head_offset=0, num_heads=4)
    shards[1].update("layer.0", max_logit=logits[2:, 2:], is_sample=sample[2:], head_offset=2, num_heads=4)
    shards[0].update("layer.0", max_logit=logits[2:, :2], is_sample=sample[2:], head_offset=0, num_heads=4)
    shards[1].update("layer.0", max_logit=logits[:2, 2:], is_sample=sample[:2], head_offset=2, num_heads=4)
    shards[0].merge_state(shards[1])
    reference_max = [
        max(float(v) for v, s in zip(logits[:, h].flatten(), sample.expand(4, 4, 7)[:, h].flatten(), strict=True) if s)
        for h in range(4)
    ]
    tau = sorted(reference_max)[1] + 1e-3
    expected = [min(1.0, tau / value) for value in reference_max]
    for metric in (whole, shards[0]):
        assert metric.compute().clip_factors(tau)[0].tolist() == pytest.approx(expected, rel=1e-12)
    empty = AttentionStatistics({"layer.0": 2})
    empty.update("layer.0", max_logit=torch.tensor([[[500.0], [1.0]]]), is_sample=torch.tensor([[[True], [False]]]))
    assert empty.compute().clip_factors(100.0)[0, 0] == pytest.approx(0.2)
    assert empty.compute().clip_factors(100.0)[0, 1].isnan() and float(empty.compute().clipped_heads(100.0)[0]) == 1
    for bad in (0.0, -1.0, math.inf, math.nan, True):
        with pytest.raises(ValueError, match="clip `threshold`"):
            empty.compute().clip_factors(bad)


def test_fit_logs_the_clip_dry_run_to_tensorboard_and_the_summary(tmp_path: Path) -> None:
    """``Statistics(clip_threshold=tau)`` in a real fit: the clip names read back from TensorBoard (and the
    per-layer count in ``trainer.callback_metrics``) equal min(1, tau / max logit) of the float64 reference
    and the heads above tau.

    tau sits between the heads' reference maxima (some clip, some do not). Fails when the core does not pass the
    threshold on (no clip names), or when the factors are not the reference's (checked by breaking each).
    """
    model = lm.TinyGPT(lr=0.0)
    with torch.no_grad():
        for block in model.blocks:
            models.sharpen(block.attn.c_attn.weight, lm.HIDDEN, 3.0)
    batches = list(lm.make_batches(2, seed=6))
    expected = {layer: pooled.head_max() for layer, pooled in tiny_gpt_reference(model.state_dict(), batches).items()}
    maxima = sorted(value for values in expected.values() for value in values)
    tau = (maxima[len(maxima) // 2 - 1] + maxima[len(maxima) // 2]) / 2
    assert maxima[0] < tau < maxima[-1] and maxima[-1] / tau > 1.05, maxima
    logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = AttentionEntropyMonitor(
        batches=2,
        statistics=Statistics(max_logit=True, clip_threshold=tau),
        log=LogOptions(histogram_bins=None, heatmap=False, per_head=True),
    )
    trainer = make_trainer(tmp_path, loggers=[logger], callbacks=[monitor], max_epochs=1, limit_train_batches=1)
    trainer.fit(model, lm.loader(lm.make_batches(1, seed=1)), lm.loader(batches))
    step = 0  # lr 0, one training batch: validation logged at step 0 with the initial weights
    logged = tb_scalars_at(read_tensorboard(logger.log_dir), step, "attn_qk_clip")
    for layer, head_max in expected.items():
        clipped = float(sum(value > tau for value in head_max))
        assert logged[f"attn_qk_clip/{layer}/clipped_heads"] == clipped
        assert float(trainer.callback_metrics[f"attn_qk_clip/{layer}/clipped_heads"]) == clipped
        for head, value in enumerate(head_max):
            name = f"attn_qk_clip_heads/{layer}/head_{head}/factor"
            assert logged[name] == pytest.approx(min(1.0, tau / value), rel=TOL)
    assert len(logged) == len(expected) * (1 + lm.HEADS)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        (lambda: Statistics(clip_threshold=100.0), ValueError, "needs `Statistics\\(max_logit=True\\)`"),
        (lambda: Statistics(max_logit=True, clip_threshold=0.0), ValueError, "clip `clip_threshold`.*got 0.0"),
        (lambda: Statistics(max_logit=True, clip_threshold="100"), ValueError, "clip `clip_threshold`"),  # type: ignore[arg-type]
    ],
)
def test_clip_threshold_is_checked_early(options: Callable[[], object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        options()
