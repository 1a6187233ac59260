"""AttentionEntropyCallback in a real 2-process ``transformers.Trainer.train()`` (gloo, CPU).

The Trainer shards each evaluation's 4 batches over the 2 processes; the
callback records the first 2 batches of each process, so together the 4,
whatever the sharding. Every process summarises (a collective) and only the
world process zero writes: the Trainer's event directory holds the values of
all 4 batches, equal to the float64 eager reference over them.

Broken variants caught (each tried, then restored): every process writing
(a second event file with half the data); a summary without the collective
(each process's counts are its own half).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from attn_monitor import LogOptions
from tests.helpers import lightning_models as lm
from tests.helpers.processes import launch
from tests.hf.test_trainer import LAYERS, STEPS, _examples, _read, _trainer
from tests.lightning.test_callback import (
    assert_spread,
    check_against_reference,
    count_queries,
    expected_names,
    hf_reference,
    in_family,
    tb_scalars_at,
)

transformers = pytest.importorskip("transformers")

EVAL_BATCHES = lm.make_batches(4, seed=6)


def _worker(rank: int, port: int, out_dir: str) -> None:
    from attn_monitor import AttentionEntropyCallback

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    os.environ.update(LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    callback = AttentionEntropyCallback(log=LogOptions(per_head=True))
    trainer = _trainer(Path(out_dir), [callback], report_to=["tensorboard"], ddp_backend="gloo")
    trainer.eval_dataset = _examples(EVAL_BATCHES)
    trainer.train()
    summary = callback.core.last_summaries[0]
    counts = {layer: int(summary.count[summary.layer_index(layer)].sum()) for layer in LAYERS}
    assert trainer.args.world_size == 2 and trainer.args.parallel_mode.value == "distributed"
    torch.save({"counts": counts, "state": trainer.model.state_dict()}, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hf_ddp")
    launch(_worker, out, 2)
    results = [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    reference = {k.removeprefix("model."): s for k, s in hf_reference(results[0]["state"], EVAL_BATCHES).items()}
    return {"out": out, "results": results, "reference": reference}


def test_every_process_summarises_all_recorded_batches(ranks: dict[str, Any]) -> None:
    reference = ranks["reference"]
    assert_spread(reference)
    want = {layer: len(reference[layer].normalized) for layer in LAYERS}
    assert sum(want.values()) == count_queries(reference)
    for result in ranks["results"]:
        assert result["counts"] == want


def test_process_zero_writes_the_reference_of_the_union_at_the_steps_of_eval_loss(ranks: dict[str, Any]) -> None:
    runs = glob.glob(str(ranks["out"] / "runs" / "*"))
    assert len(runs) == 1, runs
    assert len(glob.glob(os.path.join(runs[0], "events.out.tfevents.*"))) == 2  # the Trainer's and the monitor's
    events = _read(runs[0])
    assert [e.step for e in events.Scalars("eval/loss")] == STEPS
    tags = {tag for tag in events.Tags()["scalars"] if in_family(tag)}
    assert tags == expected_names(LAYERS, per_head=True)
    for step in STEPS:
        check_against_reference(tb_scalars_at(events, step), ranks["reference"])
