"""The runtime self-check of the fast path: a broken kernel is caught, named, and routed around.

The broken kernel is the CPU flash kernel with a base-2 logsumexp (a
convention some kernels use), monkeypatched in; every entropy the monitor
reports is compared with the float64 recomputation of tests/test_callback.py
(``gpt_reference``: TinyGPT's own projections, an explicit softmax, the
support the batch implies). The checker's own dense recomputation is checked
against tests/reference.py across mask families, bias included.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from attn_monitor import LogOptions, SelfCheck, Statistics
from attn_monitor.capture.calls import AttentionCall
from attn_monitor.capture.selfcheck import dense_lse_entropy
from attn_monitor.functional import kernels as F
from attn_monitor.functional.masks import Support
from attn_monitor.lightning.callback import AttentionEntropyMonitor
from tests.functional.test_entropy import to_support
from tests.helpers import lightning_models as lm
from tests.helpers import reference
from tests.lightning.test_callback import MEAN_TOL, gpt_reference, make_trainer

pytestmark = pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")

KERNEL = "aten._scaled_dot_product_flash_attention_for_cpu"


@pytest.fixture
def base2_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The CPU kernel returning its logsumexp in base 2; yields a list counting its calls."""
    sound = F._KERNELS["cpu"]
    calls: list[int] = []

    def broken(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        out, lse = sound(*args)
        return out, lse / math.log(2.0)

    monkeypatch.setitem(F._KERNELS, "cpu", broken)
    yield calls


def validate(
    tmp_path: Path, self_check: SelfCheck | None, batches: list[dict[str, torch.Tensor]]
) -> tuple[Any, list[str]]:
    """Fit a frozen TinyGPT for one step and validate ``batches``; the monitor and its warnings."""
    monitor = AttentionEntropyMonitor(
        batches=len(batches),
        statistics=Statistics(self_check=self_check),
        log=LogOptions(histogram_bins=None, heatmap=False),
    )
    trainer = make_trainer(tmp_path, callbacks=[monitor], max_epochs=1, limit_train_batches=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(lm.TinyGPT(lr=0.0), lm.loader(lm.make_batches(1, seed=1)), lm.loader(batches))
    return monitor, [str(w.message) for w in caught if str(w.message).startswith("attn_monitor")]


def layer_means(monitor: Any) -> list[float]:
    (summary,) = monitor.last_summaries.values()
    return summary.layer_mean.tolist()


def test_a_broken_kernel_is_caught_named_and_routed_around(tmp_path: Path, base2_kernel: list[int]) -> None:
    """With a base-2 logsumexp kernel, the first recorded batch's check warns once per layer, naming the layer,
    the kernel and the error; every layer's entropy (the checked batch included) then equals the float64
    reference, while without the check the same kernel gives wrong numbers.

    Fails when the check compares nothing (tolerance never exceeded), when a failed layer keeps the fast
    path, or when the disagreeing call's own values are kept (checked by breaking each, then restoring).
    """
    batches = lm.make_batches(3, seed=4)
    reference_means = [
        float(samples.normalized.mean()) for samples in gpt_reference(lm.TinyGPT(lr=0.0).state_dict(), batches).values()
    ]
    unchecked, silent = validate(tmp_path / "unchecked", None, batches)
    assert not any("fast entropy path" in m for m in silent)
    wrong = [abs(a - b) for a, b in zip(layer_means(unchecked), reference_means, strict=True)]
    assert min(wrong) > 0.01, "the broken kernel must give wrong numbers for this test to mean anything"
    calls_before = len(base2_kernel)

    checked, messages = validate(tmp_path / "checked", SelfCheck(), batches)
    assert layer_means(checked) == pytest.approx(reference_means, abs=MEAN_TOL)
    found = [m for m in messages if "fast entropy path" in m]
    assert len(found) == len(lm.GPT_LAYERS), found
    for layer, message in zip(lm.GPT_LAYERS, found, strict=True):
        assert f"fast entropy path of {layer!r}" in message and KERNEL in message and "nats" in message
        assert "exact path (chunked, float64) from now on" in message
    assert checked.core.recorder.check.exact_layers == set(lm.GPT_LAYERS)
    # Only the first validation batch ran the kernel, once per layer: the later ones take the exact path.
    assert len(base2_kernel) - calls_before == len(lm.GPT_LAYERS)


def test_a_sound_kernel_passes_on_the_first_and_every_nth_batch(tmp_path: Path) -> None:
    """The real kernel: no warning; ``every_n=2`` over five batches checks batches 0, 2 and 4 of each layer."""
    monitor, messages = validate(tmp_path, SelfCheck(every_n=2), lm.make_batches(5, seed=5))
    assert not any("fast entropy path" in m for m in messages), messages
    check = monitor.core.recorder.check
    assert check.checks == 3 * len(lm.GPT_LAYERS) and not check.exact_layers
    first_only, _ = validate(tmp_path / "first", SelfCheck(), lm.make_batches(5, seed=5))
    assert first_only.core.recorder.check.checks == len(lm.GPT_LAYERS)


@pytest.mark.parametrize("family", ["none", "causal_pad_left", "documents_causal", "explicit_pad", "fully_masked"])
def test_dense_recomputation_equals_the_reference(family: str) -> None:
    """The checker's float64 block (GQA keys, an additive bias, rows with no key) equals tests/reference.py."""
    generator = torch.Generator().manual_seed(len(family))
    q = 2.0 * torch.randn(2, 4, 9, 8, generator=generator, dtype=torch.float64)
    k = 2.0 * torch.randn(2, 2, 9, 8, generator=generator, dtype=torch.float64)
    spec = reference.make_spec(family, 2, 4, 9, 9, seed=7)
    dense = reference.dense_support(spec)
    bias = torch.randn(1, 4, 9, 9, generator=generator, dtype=torch.float64)
    structure = to_support(spec)
    additive = torch.where(dense, bias, -math.inf)
    keys = k.repeat_interleave(2, dim=1)
    for support, extra in ((structure, None), (Support(9, 9, mask=additive.expand(2, 4, 9, 9)), bias)):
        call = AttentionCall("layer", support, q=q, k=k)
        want_lse = reference.lse_from_qk(q, keys, dense) if extra is None else None
        scores = reference.scores_from_qk(q, keys, bias=extra)
        want_entropy = reference.entropy_from_scores(torch.where(dense, scores, 0.0), dense)
        for index in range(2):
            lse, entropy = dense_lse_entropy(call, index, 2, 8)
            torch.testing.assert_close(entropy, want_entropy[index, :, 2:8], equal_nan=True)
            if want_lse is not None:
                torch.testing.assert_close(lse, want_lse[index, :, 2:8])
    for bad in ({"every_n": 0}, {"queries": 2.5}, {"tolerance": 0.0}, {"every_n": True}):
        with pytest.raises(ValueError, match="of SelfCheck"):
            SelfCheck(**bad)  # type: ignore[arg-type]
