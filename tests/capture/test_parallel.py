"""Per-head numbers under tensor, fully sharded and pipeline parallelism equal one process on the same data.

Real CPU gloo processes run every scenario in one process group and save
what the synced metrics say; the parent checks it against the float64
reference of ``tests/parallel_models.py`` on the same data (and the
histograms against one unsharded process):

* ``tp``: the standard plan (ColwiseParallel q/k/v, RowwiseParallel o) over
  both ranks, which see the same batches: each rank's SDPA call holds 2 of
  the 4 heads, placed from the DTensor weights. Also transformers' Llama
  (grouped-query keys) with sdpa and eager attention.
* ``declared``: hand-written tensor parallelism with plain tensors, its heads
  given by :func:`~attn_monitor.declare_heads` (and a layer left whole on
  both ranks declared counted on one); without the declaration the capture
  refuses, naming the layer.
* ``fsdp``: FSDP2 (``fully_shard``), each rank its own batch; also FSDP2 on
  each attention module, whose weights are resharded when eager
  probabilities are read.
* ``pipeline``: rank 0 holds layer 0, rank 1 layer 1; merged by name.
* ``context``: q and k as DTensors sharded along the sequence are refused
  by name (skipped with one warning with ``errors="warn"``); replicated ones
  are counted once.
* 4 processes on a 2 x 2 (dp, tp) mesh, plain and with FSDP2 over dp.
* Lightning's ``ModelParallelStrategy`` (1, 2) and (2, 1) in real
  ``Trainer.fit`` runs, logs read back.

Broken variants these tests were seen to catch: heads not placed (the
issue's mix: 2 heads, doubled counts), the offset ignored (every rank at
head 0), the shard offset from the wrong mesh coordinate, a declaration's
``counted=False`` ignored (doubled counts), FSDP2's storage sharding taken
for heads (a false refusal).
"""

from __future__ import annotations

import csv
import math
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from attn_monitor import AttentionCapture, AttentionEntropy, AttentionStatistics, StatisticsUpdate, declare_heads
from attn_monitor.capture.consumers import EntropyUpdate
from tests.helpers import parallel_models as models
from tests.helpers.processes import launch

WORLD_SIZE = 2
SCENARIOS = ("tp", "declared", "fsdp", "pipeline")
MESH_SIZE = 4  # 2 x 2 data x tensor parallel
MESH_SCENARIOS = ("dp_tp", "fsdp_tp")
TOLERANCE = 1e-5  # float32 activations: row-parallel sums reorder additions


def _record(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], **capture: Any) -> dict[str, Any]:
    """Run ``data`` through ``model`` under a capture; the synced summaries as plain tensors."""
    entropy, statistics = AttentionEntropy(num_bins=50, nats_bins=20, max_keys=16), AttentionStatistics()
    with AttentionCapture(model, entropy, **capture) as attention, torch.no_grad():
        for tokens, real in data:
            with attention.recording(real, consumers=[EntropyUpdate(entropy), StatisticsUpdate(statistics)]):
                model(tokens)
    summary, peaks = entropy.compute(), statistics.compute()
    return {
        "layers": summary.layers,
        "num_heads": summary.num_heads,
        "mean": summary.mean,
        "count": summary.count,
        "histogram": summary.histogram,
        "max_logit": peaks.max_logit,
        "logit_count": peaks.logit_count,
        "names": sorted(summary.to_dict()),
    }


def _tensor_parallel(rank: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    return parallelize_module(models.TinyLlama(), mesh, models.tp_plan())  # type: ignore[arg-type]


def _hand_sharded(rank: int, declare: bool) -> nn.Module:
    """Layer 0 split by hand: each rank keeps its half of q/k/v's rows and o's columns as plain tensors,
    o's partial sums all-reduced. Layer 1 stays whole on both ranks, counted on rank 0 only."""
    model = models.TinyLlama()
    rows = slice(rank * models.HIDDEN // WORLD_SIZE, (rank + 1) * models.HIDDEN // WORLD_SIZE)
    split, whole = (model.get_submodule(name) for name in models.layer_names())
    for projection in split.projections():
        projection.weight = nn.Parameter(projection.weight[rows].clone())
    split.o_proj.weight = nn.Parameter(split.o_proj.weight[:, rows].clone())
    split.o_proj.register_forward_hook(lambda _, __, out: dist.all_reduce(out) or out)
    if declare:
        declare_heads(split, head_offset=rank * models.HEADS // WORLD_SIZE, num_heads=models.HEADS)
        declare_heads(whole, head_offset=0, num_heads=models.HEADS, counted=rank == 0)
    return model


def _pipeline_stage(rank: int) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Rank r keeps layer r only (names unchanged); its inputs are the previous stage's outputs."""
    full, stage = models.TinyLlama(), models.TinyLlama()
    del stage.layers[str(1 - rank)]

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = stage.layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers[str(rank)](x)

    data = []
    with torch.no_grad():
        for tokens, real in models.batches():
            x = full.embed(tokens)
            for index in range(rank):
                x = full.layers[str(index)](x)
            data.append((x, real))
    return Stage(), data


def _context_parallel(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    class ContextAttention(nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            try:
                return F.scaled_dot_product_attention(q, k, k, is_causal=True)
            except NotImplementedError:  # torch 2.13 has no CPU sharding strategy for the fused kernel
                return q  # the capture read the call before the kernel ran

    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("cp",))
    torch.manual_seed(3)
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    module, out = ContextAttention(), {}
    sharded = [distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k)]
    with AttentionCapture(module) as attention, attention.recording():
        try:
            module(*sharded)
        except ValueError as error:
            out["refused"] = str(error)
    with AttentionCapture(module, errors="warn") as attention, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with attention.recording():
            module(*sharded)  # inside a training run: skipped with one warning, and the model runs on
    out["skipped"], out["warned"] = attention.skipped, [str(warning.message) for warning in caught]
    entropy = AttentionEntropy(num_bins=50, nats_bins=20, max_keys=16)
    with AttentionCapture(module, entropy) as attention, attention.recording():
        module(*(distribute_tensor(t, mesh, [Replicate()]) for t in (q, k)))
    out["replicated_count"] = entropy.compute().count
    local = AttentionEntropy(num_bins=50, nats_bins=20, max_keys=16)
    with AttentionCapture(module, local) as attention, attention.recording():
        module(q, k)
    out["local_count"] = local.compute().count  # synced too: both ranks' plain calls
    return out


HF_IMPLEMENTATIONS = ("sdpa", "eager")


def _hf_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(1, 64, (2, 8), generator=generator)
    return tokens, torch.tensor([[1] * 8, [1] * 5 + [0] * 3])


def _hf_record(model: nn.Module) -> dict[str, Any]:
    """A tiny Hugging Face Llama (grouped-query attention) recorded on one padded batch."""
    tokens, mask = _hf_batch()
    entropy = AttentionEntropy(num_bins=50, nats_bins=20, max_keys=16)
    with AttentionCapture(model, entropy) as attention, torch.no_grad(), attention.recording(mask.bool()):
        model(input_ids=tokens, attention_mask=mask)
    summary = entropy.compute()
    return {"layers": summary.layers, "num_heads": summary.num_heads, "mean": summary.mean, "count": summary.count}


def _hf_tensor_parallel(implementation: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tests.helpers.models import LAYERS, hf_model

    plan: dict[str, Any] = {}
    for index in range(LAYERS):
        base = f"model.layers.{index}.self_attn"
        plan.update({f"{base}.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")})
        plan[f"{base}.o_proj"] = RowwiseParallel()
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    return parallelize_module(hf_model("llama", implementation), mesh, plan)


def _hf_fully_sharded_attention() -> nn.Module:
    """FSDP2 on every attention module itself: eager probabilities are read after it has resharded the weights."""
    from torch.distributed.fsdp import fully_shard

    from tests.helpers.models import hf_model

    model = hf_model("llama", "eager")
    for layer in model.model.layers:
        fully_shard(layer.self_attn)
    return fully_shard(model)


def _run(rank: int) -> dict[str, Any]:
    data, out = models.batches(), {}
    out["tp"] = _record(_tensor_parallel(rank), data)
    out["declared"] = _record(_hand_sharded(rank, declare=True), data)
    try:
        _record(_hand_sharded(rank, declare=False), data)
    except ValueError as error:
        out["undeclared"] = str(error)
    from torch.distributed.fsdp import fully_shard

    model = models.TinyLlama()
    for block in model.layers.values():
        fully_shard(block)
    out["fsdp"] = _record(fully_shard(model), [data[rank]])
    out["pipeline"] = _record(*_pipeline_stage(rank))
    out["context"] = _context_parallel(rank)
    for implementation in HF_IMPLEMENTATIONS:
        out[f"hf_{implementation}"] = _hf_record(_hf_tensor_parallel(implementation))
    out["hf_fsdp_eager"] = _hf_record(_hf_fully_sharded_attention())
    return out


def _mesh_run(rank: int) -> dict[str, Any]:
    """A 2 x 2 (data, tensor) mesh: each data-parallel group its own batch, plain and with FSDP2 over "dp"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    data = [models.batches()[mesh.get_local_rank("dp")]]
    out = {"dp_tp": _record(parallelize_module(models.TinyLlama(), mesh["tp"], models.tp_plan()), data)}
    model = parallelize_module(models.TinyLlama(), mesh["tp"], models.tp_plan())
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    out["fsdp_tp"] = _record(fully_shard(model, mesh=mesh["dp"]), data)
    return out


def _worker(rank: int, port: int, out_dir: str, run: Any = _run, world_size: int = WORLD_SIZE) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = run(rank)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _mesh_worker(rank: int, port: int, out_dir: str) -> None:
    _worker(rank, port, out_dir, _mesh_run, MESH_SIZE)


#: run name -> (data_parallel_size, tensor_parallel_size) of ModelParallelStrategy
LIGHTNING_RUNS = {"tp": (1, 2), "fsdp": (2, 1)}


def _lightning_worker(rank: int, port: int, out_dir: str) -> None:
    """One rank of a ``Trainer.fit`` per ModelParallelStrategy layout, launched as torchrun would."""
    import os

    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import ModelParallelStrategy

    from attn_monitor import AttentionEntropyMonitor, LogOptions, Statistics

    os.environ.update(
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD_SIZE), "NODE_RANK": "0"}
    )
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    loader = torch.utils.data.DataLoader(models.items(), batch_size=None)
    for name, (data_parallel, tensor_parallel) in LIGHTNING_RUNS.items():
        # Each data-parallel rank gets its share of the 2 validation items; the union is all of them.
        monitor = AttentionEntropyMonitor(
            batches=2 // data_parallel,
            statistics=Statistics(max_logit=True),
            log=LogOptions(heatmap=False, per_head=True),  # every head is checked against the reference
        )
        trainer = Trainer(
            accelerator="cpu",
            devices=WORLD_SIZE,
            strategy=ModelParallelStrategy(data_parallel_size=data_parallel, tensor_parallel_size=tensor_parallel),
            max_epochs=1,
            limit_train_batches=1,
            num_sanity_val_steps=0,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            logger=CSVLogger(out_dir, name=name, version=0),
            callbacks=[monitor],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(models.ParallelLM(), loader, loader)
        (summary,) = monitor.last_summaries.values()
        saved = {"layers": summary.layers, "num_heads": summary.num_heads, "count": summary.count}
        torch.save(saved, f"{out_dir}/{name}{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank of a real 2-process gloo group saved."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out_dir = tmp_path_factory.mktemp("parallel")
    _record(models.TinyLlama(), models.batches()[:1])  # warm lazy imports before forking
    launch(_worker, out_dir, WORLD_SIZE)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def mesh_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank of a real 4-process gloo group on a 2 x 2 (dp, tp) mesh saved."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out_dir = tmp_path_factory.mktemp("mesh")
    launch(_mesh_worker, out_dir, MESH_SIZE)
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(MESH_SIZE)]


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of 2-process ``Trainer.fit`` runs under ModelParallelStrategy: logs, each rank's summaries."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out_dir = tmp_path_factory.mktemp("lightning")
    launch(_lightning_worker, out_dir, WORLD_SIZE)
    return out_dir


@pytest.fixture(scope="module")
def expected() -> dict[str, dict[str, torch.Tensor]]:
    return models.reference_statistics(models.TinyLlama(), models.batches())


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    return _record(models.TinyLlama(), models.batches())


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_head_equals_the_reference(
    ranks: list[dict[str, Any]], expected: dict[str, dict[str, torch.Tensor]], scenario: str
) -> None:
    _check_every_head([rank[scenario] for rank in ranks], expected, scenario)


@pytest.mark.parametrize("scenario", MESH_SCENARIOS)
def test_a_data_by_tensor_parallel_mesh_equals_the_reference(
    mesh_ranks: list[dict[str, Any]], expected: dict[str, dict[str, torch.Tensor]], scenario: str
) -> None:
    """4 processes: ranks of one tensor-parallel group share a batch, the two groups see different ones."""
    _check_every_head([rank[scenario] for rank in mesh_ranks], expected, scenario)


def _check_every_head(
    results: list[dict[str, Any]], expected: dict[str, dict[str, torch.Tensor]], scenario: str
) -> None:
    for got in results:
        assert sorted(got["layers"]) == models.layer_names()
        assert got["num_heads"] == [models.HEADS] * models.LAYERS
        for name in models.layer_names():
            index, truth = got["layers"].index(name), expected[name]
            assert torch.equal(got["count"][index], truth["count"].double()), (scenario, name)
            assert torch.equal(got["logit_count"][index], truth["count"].double() + _single_key(name))
            torch.testing.assert_close(got["mean"][index], truth["mean"], atol=TOLERANCE, rtol=0)
            torch.testing.assert_close(got["max_logit"][index], truth["max_logit"], atol=TOLERANCE, rtol=1e-6)
        heads = {f"attn_entropy_heads/{name}/head_{head}/mean" for name in models.layer_names() for head in range(4)}
        assert heads <= set(got["names"])


def _single_key(name: str) -> torch.Tensor:
    """Real queries with one visible key (the first of each sequence): counted by the max logit, not entropy."""
    return torch.full((models.HEADS,), 4.0, dtype=torch.float64)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_histograms_equal_one_process(ranks: list[dict[str, Any]], one_process: dict[str, Any], scenario: str) -> None:
    got = ranks[0][scenario]
    order = [got["layers"].index(name) for name in one_process["layers"]]
    # One bin at most apart: float32 activations of a sharded run may cross a bin edge.
    moved = (got["histogram"][order] - one_process["histogram"]).abs().sum()
    assert moved <= 2, f"{scenario}: {moved} queries changed bins"
    assert torch.equal(got["histogram"][order].sum(-1), one_process["histogram"].sum(-1))


@pytest.mark.parametrize("scenario", ["fsdp", "pipeline"])
def test_sharded_parameters_and_stages_are_one_process_bit_for_bit(
    ranks: list[dict[str, Any]], one_process: dict[str, Any], scenario: str
) -> None:
    """FSDP2 gathers the same weights and a stage runs the same layer: nothing is summed in another order."""
    got = ranks[0][scenario]
    order = [got["layers"].index(name) for name in one_process["layers"]]
    for name in ("mean", "count", "histogram", "max_logit", "logit_count"):
        assert torch.equal(got[name][order], one_process[name]), (scenario, name)


@pytest.mark.parametrize("implementation", HF_IMPLEMENTATIONS)
def test_a_hugging_face_llama_under_tensor_parallelism_equals_one_process(
    ranks: list[dict[str, Any]], implementation: str
) -> None:
    """transformers' Llama (grouped-query keys; eager: probabilities, placed by the module's head_dim)."""
    from tests.helpers.models import HEADS, hf_model

    alone = _hf_record(hf_model("llama", implementation))
    assert float(alone["mean"].std()) > 0.01, "per-head means must differ, or a head mix-up would not show"
    for rank in ranks:
        got = rank[f"hf_{implementation}"]
        assert got["layers"] == alone["layers"] and got["num_heads"] == [HEADS] * len(alone["layers"])
        assert torch.equal(got["count"], alone["count"])
        torch.testing.assert_close(got["mean"], alone["mean"], atol=TOLERANCE, rtol=0)


def test_weights_fsdp_resharded_before_the_read_are_not_tensor_parallel(ranks: list[dict[str, Any]]) -> None:
    """FSDP2 shards rows over the data-parallel mesh, not heads: every rank holds all heads of its own batch."""
    from tests.helpers.models import hf_model

    alone = _hf_record(hf_model("llama", "eager"))
    for rank in ranks:
        got = rank["hf_fsdp_eager"]
        assert got["layers"] == alone["layers"]
        assert torch.equal(got["count"], 2 * alone["count"])  # both ranks ran the same batch
        torch.testing.assert_close(got["mean"], alone["mean"], atol=TOLERANCE, rtol=0)


def test_heads_without_placement_are_refused_by_name(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        message = rank["undeclared"]
        assert "'layers.0.attn'" in message and "2 heads" in message and "declare_heads" in message


def test_context_parallel_calls_are_refused_by_name(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        context = rank["context"]
        assert "'ContextAttention'" in context["refused"] and "sequence" in context["refused"]
        assert context["skipped"] == {"ContextAttention": 1}
        assert sum("'ContextAttention'" in message and "sequence" in message for message in context["warned"]) == 1
        # Replicated q and k: every rank holds the same queries; one counts them.
        assert torch.equal(context["replicated_count"] * 2, context["local_count"])
        assert context["replicated_count"].sum() > 0


def test_reference_pools_every_query(expected: dict[str, dict[str, torch.Tensor]]) -> None:
    """2 + 2 sequences of 6 causal queries, 2 padding queries, 4 first queries with one key: 18 per head."""
    for truth in expected.values():
        assert truth["count"].tolist() == [18.0] * models.HEADS
        assert not math.isclose(float(truth["mean"].min()), float(truth["mean"].max()), abs_tol=0.05)


def test_a_slice_of_heads_lands_at_its_offset() -> None:
    """Without processes: two slices written at their offsets make one layer of four heads."""
    metric = AttentionEntropy(num_bins=10, nats_bins=10, max_keys=16)
    entropy = torch.full((1, 2, 3), math.log(4.0))
    metric.update("attn", entropy, torch.tensor(4), head_offset=2, num_heads=4)
    assert metric.compute().count.tolist() == [[0.0, 0.0, 3.0, 3.0]]
    metric.update("attn", entropy * 0.5, torch.tensor(4), head_offset=0, num_heads=4)
    torch.testing.assert_close(metric.compute().mean, torch.tensor([[0.5, 0.5, 1.0, 1.0]], dtype=torch.float64))


def test_slices_that_do_not_fit_are_refused_by_name() -> None:
    metric = AttentionEntropy(num_bins=10, nats_bins=10, max_keys=16)
    with pytest.raises(ValueError, match=r"Layer 'attn': heads 3 \.\.\. 4 do not fit in its 4 heads"):
        metric.update("attn", torch.zeros(1, 2, 3), torch.tensor(4), head_offset=3, num_heads=4)
    with pytest.raises(ValueError, match="head_offset"):
        declare_heads(nn.Linear(2, 2), head_offset=-1, num_heads=4)
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        declare_heads("attn", head_offset=0, num_heads=4)  # type: ignore[arg-type]


@pytest.mark.parametrize("run", list(LIGHTNING_RUNS))
def test_model_parallel_strategy_logs_every_head_of_the_reference(
    lightning_run: Path, expected: dict[str, dict[str, torch.Tensor]], run: str
) -> None:
    """A real ``Trainer.fit`` (tp: ``ModelParallelStrategy(1, 2)``, fsdp: ``(2, 1)``): rank 0's CSV log of
    per-head means and max logits, every rank's summary counts."""
    with open(lightning_run / run / "version_0" / "metrics.csv", newline="") as handle:
        logged: dict[str, float] = {}
        for row in csv.DictReader(handle):
            logged.update({name: float(value) for name, value in row.items() if value not in ("", None)})
    summaries = [torch.load(lightning_run / f"{run}{rank}.pt") for rank in range(WORLD_SIZE)]
    for name in models.layer_names():
        truth, layer = expected[name], f"model.{name}"
        for summary in summaries:
            index = summary["layers"].index(layer)
            assert summary["num_heads"][index] == models.HEADS
            assert torch.equal(summary["count"][index], truth["count"].double())
        for head in range(models.HEADS):
            mean = logged[f"attn_entropy_heads/{layer}/head_{head}/mean"]
            assert mean == pytest.approx(float(truth["mean"][head]), abs=TOLERANCE), (layer, head)
            peak = logged[f"attn_max_logit_heads/{layer}/head_{head}/max"]
            assert peak == pytest.approx(float(truth["max_logit"][head]), abs=TOLERANCE), (layer, head)
