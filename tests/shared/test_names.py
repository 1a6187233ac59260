"""One naming function for every API: ``to_dict``, the Lightning monitor, the Hugging Face callback, Fabric.

Each test compares the names (and values) an API logs with those of
:meth:`EntropySummary.to_dict` for the same model and batches; they fail when
any of them names per-head values its own way (``attn_entropy/{layer}/head_{h}``
in ``to_dict`` against ``attn_entropy_heads/...`` in the monitor, as before).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from attn_monitor import AttentionEntropyMonitor, LogOptions, evaluate_attention
from attn_monitor.shared.names import head_name
from tests.helpers import lightning_models as lm
from tests.lightning.test_callback import PREFIX, in_family, make_trainer


def per_head_names(layers: list[str], heads: int) -> set[str]:
    """The README's per-head entropy names: ``attn_entropy_heads/{layer}/head_{h}/mean`` and ``/q50``."""
    stats = ("mean", "q50")
    return {f"{PREFIX}_heads/{layer}/head_{h}/{stat}" for layer in layers for h in range(heads) for stat in stats}


def test_head_name_is_the_heads_group_of_the_family() -> None:
    assert head_name("attn_sink_mass", "h.0.attn", 1, "mean") == "attn_sink_mass_heads/h.0.attn/head_1/mean"


def test_lightning_monitor_logs_the_names_and_values_of_to_dict(tmp_path: Path) -> None:
    """A real fit with per-head values: the validation's entropy names are exactly ``to_dict(per_head=True)``'s."""
    logger = lm.MemoryLogger()
    model = lm.TinyGPT(lr=0.0)
    val = lm.make_batches(3, seed=11)
    monitor = AttentionEntropyMonitor(batches=2, log=LogOptions(per_head=True))
    trainer = make_trainer(tmp_path, loggers=[logger], callbacks=[monitor], max_epochs=1, limit_train_batches=1)
    trainer.fit(model, lm.loader(lm.make_batches(1, seed=10)), lm.loader(val))
    logged = {
        name: value for _, metrics in logger.merged_records() for name, value in metrics.items() if in_family(name)
    }
    want = evaluate_attention(model, val[:2]).to_dict(PREFIX, per_head=True)
    assert set(logged) == set(want)
    assert {name for name in want if "/head_" in name} == per_head_names(lm.GPT_LAYERS, lm.HEADS)
    assert logged == pytest.approx(want, rel=1e-6)
