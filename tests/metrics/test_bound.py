"""The free max-logit bound: ``[max_i (lse_i - H_i), max_i lse_i]`` per head, from the entropy pass.

Each end is checked against the float64 reference (tests/reference.py: every
query's logsumexp, entropy and max logit recomputed key by key over the
support its mask implies), and the bracket against the reference max logit,
across mask families (padding, causal, packed documents, windows, explicit
masks, fully masked rows, one visible key per row where the bracket closes),
through the monitor's own entropy consumer on each path (fused, chunked,
eager logits), merged over two metrics and, in a real fit, on training steps.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from attn_monitor import Batches, LogOptions, Statistics
from attn_monitor.capture.calls import AttentionCall
from attn_monitor.capture.consumers import EntropyUpdate
from attn_monitor.lightning.callback import AttentionEntropyMonitor
from attn_monitor.metrics.bound import LogitBound, LogitBoundSummary
from attn_monitor.metrics.entropy import AttentionEntropy
from tests.functional.test_entropy import to_support
from tests.helpers import lightning_models as lm
from tests.helpers import reference
from tests.lightning.test_callback import make_trainer, read_tensorboard, tb_scalars_at
from tests.metrics.test_statistics import tiny_gpt_reference

FAMILIES = [
    "none",
    "pad_right",
    "causal_pad_left",
    "documents_causal",
    "window_pad_causal",
    "explicit_pad",
    "fully_masked",
    "one_valid",
]
TOL = 2e-5


def reference_bracket(q: torch.Tensor, k: torch.Tensor, spec: reference.MaskSpec) -> dict[str, list[float]]:
    """Per head, over the counted queries: max (lse - H), max lse and the max logit, in float64."""
    dense, counted = reference.dense_support(spec), reference.is_sample(spec)
    lse = reference.lse_from_qk(q, k, dense)
    entropy = reference.entropy_from_qk(q, k, dense)
    peak = reference.max_logit_from_qk(q, k, dense)
    out: dict[str, list[float]] = {"lower": [], "upper": [], "max": [], "width": []}
    for head in range(q.shape[1]):
        rows = counted[:, head]
        out["lower"].append(max((lse - entropy)[:, head][rows].tolist()))
        out["upper"].append(max(lse[:, head][rows].tolist()))
        out["max"].append(max(peak[:, head][rows].tolist()))
        out["width"].append(max(entropy[:, head][rows].tolist()))
    return out


def random_call(family: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, reference.MaskSpec]:
    generator = torch.Generator().manual_seed(seed)
    q = 2.0 * torch.randn(2, 3, 9, 8, generator=generator)  # spread logits: the bracket is not trivial
    k = 2.0 * torch.randn(2, 3, 9, 8, generator=generator)
    return q, k, reference.make_spec(family, 2, 3, 9, 9, seed=seed)


def bound_of(call: AttentionCall, spec: reference.MaskSpec, method: str = "auto") -> LogitBoundSummary:
    """What the monitor's entropy consumer puts into a LogitBound for ``call`` (real queries as samples)."""
    bound = LogitBound()
    sample = call.support.is_sample() & reference.query_is_real(spec)[:, None, :]
    EntropyUpdate(AttentionEntropy(), method=method, bound=bound)(call, sample)  # type: ignore[arg-type]
    return bound.compute()


@pytest.mark.parametrize("method", ["fused", "chunked", "logits"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bound_ends_equal_the_reference_and_bracket_its_max_logit(family: str, method: str) -> None:
    """Each end equals the float64 reference's max (lse - H) and max lse over the counted queries, and the
    reference max logit lies between them; with one visible key per row the bracket closes on it.

    Fails when the lower end is taken as min over queries or as lse - ln n, when queries with no visible
    key or padding queries are counted (their lse is -inf/0 and would move the ends), or when the upper end
    is the max logit plus ln n (checked by breaking each, then restoring).
    """
    q, k, spec = random_call(family, seed=len(family))
    support = to_support(spec)
    if method == "logits":
        dense = reference.dense_support(spec)
        logits = torch.where(dense, q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -math.inf)
        call = AttentionCall("layer", support, logits=logits, probs=logits.softmax(-1).nan_to_num())
        summary = bound_of(call, spec)
    else:
        summary = bound_of(AttentionCall("layer", support, q=q, k=k), spec, method)
    want = reference_bracket(q, k, spec)
    lower, upper = summary.lower[0].tolist(), summary.upper[0].tolist()
    assert lower == pytest.approx(want["lower"], rel=TOL, abs=TOL)
    assert upper == pytest.approx(want["upper"], rel=TOL, abs=TOL)
    for head, peak in enumerate(want["max"]):
        assert lower[head] <= peak + TOL and peak <= upper[head] + TOL, (head, lower[head], peak, upper[head])
        assert upper[head] - lower[head] <= want["width"][head] + TOL  # no wider than the widest query's H
    if family == "one_valid":
        assert upper == pytest.approx(want["max"], abs=TOL) and lower == pytest.approx(want["max"], abs=TOL)
    else:
        assert max(want["width"]) > 0.5  # queries far from one-hot: lse and lse - H differ, the ends mean something
    counted = reference.is_sample(spec).sum((0, 2)).tolist()
    assert summary.count[0].tolist() == counted


def test_bound_merges_by_max_and_names_follow_the_rule() -> None:
    """Two metrics that saw halves of the batch merge to the ends of one metric that saw all of it; names are
    ``{family}/{layer}/lower|upper`` (max over heads) and ``{family}_heads/{layer}/head_{h}/...``."""
    q, k, spec = random_call("causal_pad_left", seed=3)
    support, real = to_support(spec), reference.query_is_real(spec)
    halves = [LogitBound(), LogitBound()]
    whole = LogitBound()
    lse, entropy = reference.lse_from_qk(q, k, reference.dense_support(spec)), None
    entropy = reference.entropy_from_qk(q, k, reference.dense_support(spec))
    sample = support.is_sample() & real[:, None, :]
    whole.update("layer", lse, entropy, sample)
    for index, metric in enumerate(halves):
        rows = slice(index, index + 1)
        metric.update("layer", lse[rows], entropy[rows], sample[rows])
    halves[0].merge_state(halves[1])
    merged, single = halves[0].compute(), whole.compute()
    assert torch.equal(merged.lower, single.lower) and torch.equal(merged.upper, single.upper)
    want = reference_bracket(q, k, spec)
    names = single.to_dict()
    assert names["attn_max_logit_bound/layer/upper"] == pytest.approx(max(want["upper"]), rel=1e-12)
    assert names["attn_max_logit_bound/layer/lower"] == pytest.approx(max(want["lower"]), rel=1e-12)
    assert names["attn_max_logit_bound_heads/layer/head_2/lower"] == pytest.approx(want["lower"][2], rel=1e-12)
    assert len(names) == 2 + 2 * 3 and len(single.to_dict(per_head=False)) == 2
    empty = LogitBound({"layer": 2})
    assert empty.compute().to_dict() == {} and empty.compute().lower.isnan().all()


@pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")
def test_fit_logs_the_bound_on_training_steps_and_validations(tmp_path: Path) -> None:
    """In a real fit, TensorBoard holds ``attn_max_logit_bound_train/...`` at each recorded training step and
    ``attn_max_logit_bound/...`` at the validation; each validation bracket holds the float64 reference max
    logit of the weights that validation saw, and training steps the reference of their own batch and weights.

    Fails when training streams get no bound (the family is missing) or when validation and training
    names are swapped (checked by breaking each).
    """
    logger = TensorBoardLogger(tmp_path, name="tb")
    monitor = AttentionEntropyMonitor(
        batches=Batches(2, train_every_n_steps=1),
        statistics=Statistics(max_logit_bound=True),
        log=LogOptions(histogram_bins=None, heatmap=False, per_head=True),
    )
    recorder = lm.BatchRecorder(train_every=1)
    trainer = make_trainer(tmp_path, loggers=[logger], callbacks=[monitor, recorder], max_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(lm.TinyGPT(), lm.loader(lm.make_batches(2, seed=1)), lm.loader(lm.make_batches(2, seed=2)))
    events = read_tensorboard(logger.log_dir)
    checked = 0
    records = [
        (entry["step"], entry["state"], [entry["batch"]], "attn_max_logit_bound_train") for entry in recorder.train
    ]
    validation = recorder.validations[0]
    records.append((validation["step"] - 1, validation["state"], validation["batches"], "attn_max_logit_bound"))
    for step, state, batches, family in records:
        logged = tb_scalars_at(events, step, family)
        expected = tiny_gpt_reference(state, batches)
        for layer, pooled in expected.items():
            lower = logged[f"{family}/{layer}/lower"]
            upper = logged[f"{family}/{layer}/upper"]
            peak = max(pooled.head_max())
            assert lower - TOL <= peak <= upper + TOL, (family, step, layer, lower, peak, upper)
            for head, head_peak in enumerate(pooled.head_max()):
                low = logged[f"{family}_heads/{layer}/head_{head}/lower"]
                high = logged[f"{family}_heads/{layer}/head_{head}/upper"]
                assert low - TOL <= head_peak <= high + TOL
            checked += 1
    assert checked == len(lm.GPT_LAYERS) * (len(recorder.train) + 1) and len(recorder.train) == 2
