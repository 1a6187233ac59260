"""Saving, loading and comparing EntropySummary objects, and the ``attn-monitor compare`` command line.

Summaries are built by feeding :class:`AttentionEntropy` samples of normalised
entropy we choose (as nats: ``h * ln(num_valid)``), so every expected shift
is known. The Wasserstein-1 reference works on those samples directly with
numpy, sharing nothing with the histogram code: W1 between two empirical
distributions on the line is the mean absolute difference of their quantile
functions, integrated here on a fine midpoint grid. The histogram W1 puts
every sample at its bin centre, so it must agree within one bin width.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attn_monitor import AttentionEntropy, EntropySummary
from attn_monitor.__main__ import main
from attn_monitor.report.archive import FORMAT_NAME, FORMAT_VERSION, load_summary, save_summary
from attn_monitor.report.comparison import REMINDER, Comparison, compare

NUM_VALID = 16
LOG_N = math.log(NUM_VALID)
ROW_KEYS = {"layer", "head", "mean_a", "mean_b", "mean_shift", "median_shift", "w1"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- helpers


def summary_of(layers: dict[str, np.ndarray], *, num_bins: int = 1000) -> EntropySummary:
    """A summary of normalised-entropy samples, one (batch, heads, query) array per layer."""
    metric = AttentionEntropy(num_bins=num_bins)
    for name, values in layers.items():
        entropy = torch.from_numpy(np.asarray(values, dtype=np.float64) * LOG_N)
        metric.update(name, entropy, torch.tensor(NUM_VALID))
    return metric.compute()


def one_head(values: np.ndarray, *, num_bins: int = 1000) -> EntropySummary:
    """A one-layer, one-head summary of a flat sample array."""
    return summary_of({"layer": np.asarray(values).reshape(1, 1, -1)}, num_bins=num_bins)


def reference_w1(a: np.ndarray, b: np.ndarray, grid: int = 100_000) -> float:
    """W1 of the empirical distributions: mean |Q_a(u) - Q_b(u)| over u on a fine midpoint grid of (0, 1)."""
    u = (np.arange(grid) + 0.5) / grid
    quantile_a = np.quantile(np.asarray(a, dtype=np.float64), u, method="inverted_cdf")
    quantile_b = np.quantile(np.asarray(b, dtype=np.float64), u, method="inverted_cdf")
    return float(np.mean(np.abs(quantile_a - quantile_b)))


def rich_summary(seed: int = 0) -> EntropySummary:
    """Two layers of 3 and 2 heads (padded slot), mixed valid-key counts, padding queries, both histograms."""
    rng = np.random.default_rng(seed)
    metric = AttentionEntropy(num_bins=200, nats_bins=50, max_keys=64)
    for name, heads in (("encoder.layers.0.self_attn", 3), ("encoder.layers.1.self_attn", 2)):
        for _ in range(3):
            shape = (2, heads, 7)
            num_valid = rng.integers(0, 20, size=shape)
            entropy = rng.random(shape) * np.log(np.maximum(num_valid, 1))
            is_sample = rng.random((2, 1, 7)) < 0.8
            entropy[0, 0, 0] = math.nan  # a diverged query: counted in `nonfinite` when it is a sample
            metric.update(name, torch.from_numpy(entropy), torch.from_numpy(num_valid), torch.from_numpy(is_sample))
    return metric.compute()


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


# --------------------------------------------------------------------------- save / load


def test_round_trip_keeps_every_statistic(tmp_path: Path) -> None:
    summary = rich_summary()
    path = tmp_path / "summary.pt"
    save_summary(summary, path)
    loaded = load_summary(path)

    assert loaded.layers == summary.layers
    assert loaded.num_heads == summary.num_heads == [3, 2]
    assert loaded.max_nats == summary.max_nats
    for name in ("hist", "hist_nats", "count", "sum", "sum_sq", "sum_nats", "seq_sum", "seq_count", "single_key"):
        assert_same(loaded.stats(name), summary.stats(name))
    assert_same(loaded.stats("no_key"), summary.stats("no_key"))
    assert_same(loaded.nonfinite, summary.nonfinite)
    assert summary.no_key.sum() > 0 and summary.single_key.sum() > 0, "the data must exercise the excluded counters"
    assert summary.nonfinite.sum() > 0
    for derived in ("mean", "mean_seq", "std", "nats_mean", "layer_mean", "layer_mean_seq", "layer_std"):
        assert_same(getattr(loaded, derived), getattr(summary, derived))
    for q in (0.05, 0.5, 0.95):
        assert_same(loaded.quantile(q), summary.quantile(q))
        assert_same(loaded.layer_quantile(q), summary.layer_quantile(q))
    assert loaded.to_dict() == summary.to_dict()
    assert repr(loaded) == repr(summary)


def test_saved_file_is_the_documented_plain_dict(tmp_path: Path) -> None:
    summary = rich_summary()
    path = tmp_path / "summary.pt"
    save_summary(summary, str(path))
    payload = torch.load(path, weights_only=True)
    assert set(payload) == {"format", "version", "layers", "num_heads", "max_nats", "stats"}
    assert payload["format"] == FORMAT_NAME == "attn_monitor.EntropySummary"
    assert payload["version"] == FORMAT_VERSION == 1
    assert payload["layers"] == summary.layers and payload["num_heads"] == summary.num_heads
    assert payload["max_nats"] == pytest.approx(math.log(64))
    assert payload["stats"]["hist"].shape == (2, 3, 200)
    assert payload["stats"]["hist_nats"].shape == (2, 3, 50)
    assert all(tensor.dtype == torch.float64 for tensor in payload["stats"].values())
    assert [entry.name for entry in tmp_path.iterdir()] == ["summary.pt"], "no temporary file left behind"


def test_format_covers_every_metric_statistic() -> None:
    # The file format lists its statistics itself; a new statistic in the metric needs a format version bump
    # (or an optional entry that older readers skip).
    from attn_monitor.report.comparison import _OPTIONAL_V1, _STATS_V1

    assert set(_STATS_V1 + _OPTIONAL_V1) == set(AttentionEntropy().statistics())


@pytest.mark.filterwarnings("ignore:The ``compute`` method:UserWarning")  # an empty metric, on purpose
def test_round_trip_of_an_empty_summary(tmp_path: Path) -> None:
    empty = AttentionEntropy(num_bins=10).compute()
    save_summary(empty, tmp_path / "empty.pt")
    loaded = load_summary(tmp_path / "empty.pt")
    assert loaded.layers == [] and loaded.histogram.shape == (0, 0, 10)
    comparison = compare(loaded, loaded)
    assert comparison.rows() == []
    assert comparison.table().splitlines()[-1] == REMINDER


def test_file_without_nonfinite_counts_loads_with_zeros(tmp_path: Path) -> None:
    """Files written before the `nonfinite` statistic existed still load."""
    payload = _payload(tmp_path)
    del payload["stats"]["nonfinite"]
    torch.save(payload, tmp_path / "older.pt")
    loaded = load_summary(tmp_path / "older.pt")
    assert loaded.nonfinite.shape == loaded.count.shape and loaded.nonfinite.sum() == 0
    assert_same(loaded.mean, load_summary(tmp_path / "good.pt").mean)


def test_save_rejects_other_objects(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="EntropySummary"):
        save_summary({"layers": []}, tmp_path / "x.pt")  # type: ignore[arg-type]


def _payload(tmp_path: Path) -> dict:
    save_summary(rich_summary(), tmp_path / "good.pt")
    return torch.load(tmp_path / "good.pt", weights_only=True)


def _edit(change):
    def write(tmp_path: Path, path: Path) -> None:
        payload = _payload(tmp_path)
        change(payload)
        torch.save(payload, path)

    return write


def _bytes(data: bytes):
    def write(tmp_path: Path, path: Path) -> None:
        path.write_bytes(data)

    return write


def _truncated(keep):
    def write(tmp_path: Path, path: Path) -> None:
        save_summary(rich_summary(), tmp_path / "good.pt")
        data = (tmp_path / "good.pt").read_bytes()
        path.write_bytes(data[: keep(len(data))])

    return write


def _plain(obj):
    def write(tmp_path: Path, path: Path) -> None:
        torch.save(obj, path)

    return write


def _set(key: str, value: object):
    return _edit(lambda payload: payload.__setitem__(key, value))


def _stat(kind: str, change):
    return _edit(lambda payload: payload["stats"].__setitem__(kind, change(payload["stats"][kind])))


BAD_FILES = {
    "text": (_bytes(b"layer,head,mean\n0,0,0.5\n"), "not a torch file"),
    "random-bytes": (_bytes(np.random.default_rng(0).bytes(4096)), "not a torch file"),
    "empty": (_bytes(b""), "not a torch file"),
    "truncated-half": (_truncated(lambda n: n // 2), "truncated"),
    "truncated-tail": (_truncated(lambda n: n - 10), "truncated"),
    "truncated-head": (_truncated(lambda n: 64), "truncated"),
    "a-tensor": (_plain(torch.zeros(3)), "found a Tensor"),
    "other-format": (_set("format", "my_tool.Checkpoint"), "my_tool.Checkpoint"),
    "no-format": (_edit(lambda payload: payload.pop("format")), "expected format"),
    "future-version": (_set("version", 2), "version 2 is not supported.*newer.*reads version 1"),
    "version-zero": (_set("version", 0), "version 0 is not supported; this attn_monitor reads version 1"),
    "version-as-text": (_set("version", "1"), "version '1' is not supported"),
    "missing-stats": (_edit(lambda payload: payload.pop("stats")), r"missing key\(s\) \['stats'\]"),
    "missing-a-stat": (_edit(lambda payload: payload["stats"].pop("seq_sum")), r"lacks \['seq_sum'\]"),
    "layers-not-names": (_set("layers", [0, 1]), "`layers` must be a list"),
    "duplicate-layer": (_set("layers", ["a", "a"]), "holds a name twice"),
    "heads-per-layer": (_set("num_heads", [3]), "one positive int per layer"),
    "heads-vs-shapes": (_set("num_heads", [4, 2]), r"stats\['hist'\] has shape \(2, 3, 200\), expected"),
    "bad-max-nats": (_set("max_nats", -1.0), "`max_nats` must be a positive number"),
    "count-shape": (_stat("count", lambda t: t[:, :2]), r"stats\['count'\] has shape \(2, 2\), expected \(2, 3\)"),
    "hist-no-bins": (_stat("hist", lambda t: t[..., 0]), r"stats\['hist'\] has shape \(2, 3\)"),
    "nan": (_stat("sum", lambda t: t.fill_(math.nan)), "NaN or infinite"),
    "negative-count": (_stat("count", lambda t: -t - 1), "negative counts"),
    "bool-stat": (_stat("no_key", lambda t: t > 0), "real-valued tensor"),
}


@pytest.mark.parametrize("case", list(BAD_FILES), ids=list(BAD_FILES))
def test_bad_files_raise_value_error_naming_path_and_problem(tmp_path: Path, case: str) -> None:
    write, message = BAD_FILES[case]
    path = tmp_path / f"{case}.pt"
    write(tmp_path, path)
    with pytest.raises(ValueError, match=message) as caught:
        load_summary(path)
    assert str(path) in str(caught.value)
    assert "\n" not in str(caught.value), "one line, not torch's paragraphs"


class _Payload:
    """Unpickling this would create a directory: the safe loader must refuse before that."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_objects_that_could_run_code_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "was-executed"
    path = tmp_path / "evil.pt"
    torch.save({"format": FORMAT_NAME, "version": 1, "payload": _Payload(marker)}, path)
    with pytest.raises(ValueError, match="could run code") as caught:
        load_summary(path)
    assert str(path) in str(caught.value)
    assert not marker.exists()


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_summary(tmp_path / "nowhere.pt")


# --------------------------------------------------------------------------- compare


def test_a_summary_compared_with_itself_has_no_change() -> None:
    summary = rich_summary()
    comparison = compare(summary, summary)
    has_data = summary.count > 0
    assert_same(comparison.w1[has_data], torch.zeros(int(has_data.sum()), dtype=torch.float64))
    assert_same(comparison.mean_shift[has_data], torch.zeros(int(has_data.sum()), dtype=torch.float64))
    assert_same(comparison.median_shift[has_data], torch.zeros(int(has_data.sum()), dtype=torch.float64))
    assert torch.isnan(comparison.w1[~has_data]).all()
    assert len(comparison.rows()) == sum(summary.num_heads) == 5


def test_known_shift_of_every_entropy() -> None:
    rng = np.random.default_rng(1)
    before = rng.uniform(0.1, 0.8, size=(4, 3, 500))
    comparison = compare(summary_of({"layer": before}), summary_of({"layer": before + 0.1}))
    bin_width = 1 / 1000
    assert comparison.bin_width == bin_width
    torch.testing.assert_close(comparison.mean_shift, torch.full((1, 3), 0.1, dtype=torch.float64), rtol=0, atol=1e-9)
    assert (comparison.w1 - 0.1).abs().max() <= bin_width
    assert (comparison.median_shift - 0.1).abs().max() <= 2 * bin_width
    torch.testing.assert_close(comparison.mean_a, torch.from_numpy(before.mean((0, 2)))[None], rtol=0, atol=1e-12)


DISTRIBUTIONS = {
    # name: (sampler of A, sampler of B); sizes differ on purpose.
    "beta-2-5-vs-5-2": (lambda rng: rng.beta(2, 5, 3000), lambda rng: rng.beta(5, 2, 2000)),
    "uniform-vs-extremes-same-mean": (
        lambda rng: rng.uniform(0.0, 1.0, 4000),
        lambda rng: np.where(rng.random(4000) < 0.5, rng.uniform(0.0, 0.05, 4000), rng.uniform(0.95, 1.0, 4000)),
    ),
    "narrow-vs-wide": (lambda rng: rng.normal(0.5, 0.02, 2500).clip(0, 1), lambda rng: rng.uniform(0.2, 0.8, 1500)),
    "one-hot-vs-uniform": (lambda rng: np.zeros(100), lambda rng: np.ones(300)),
}


@pytest.mark.parametrize("num_bins", [100, 1000], ids=["100-bins", "1000-bins"])
@pytest.mark.parametrize("case", list(DISTRIBUTIONS), ids=list(DISTRIBUTIONS))
def test_w1_matches_the_empirical_reference(case: str, num_bins: int) -> None:
    rng = np.random.default_rng(2)
    sample_a, sample_b = (sampler(rng) for sampler in DISTRIBUTIONS[case])
    comparison = compare(one_head(sample_a, num_bins=num_bins), one_head(sample_b, num_bins=num_bins))
    expected = reference_w1(sample_a, sample_b)
    assert abs(float(comparison.w1[0, 0]) - expected) <= 1 / num_bins + 1e-4
    assert float(comparison.mean_shift[0, 0]) == pytest.approx(sample_b.mean() - sample_a.mean(), abs=1e-12)


def test_w1_sees_a_change_the_mean_hides() -> None:
    rng = np.random.default_rng(3)
    spread = rng.uniform(0.0, 1.0, 5000)
    split = np.where(rng.random(5000) < 0.5, 0.0, 1.0)
    comparison = compare(one_head(spread), one_head(split))
    assert abs(float(comparison.mean_shift[0, 0])) < 0.02
    assert float(comparison.w1[0, 0]) == pytest.approx(0.25, abs=0.01)  # integral of |u - 1/2| over (0, 1)


def test_one_hot_to_uniform_is_the_largest_distance() -> None:
    comparison = compare(one_head(np.zeros(10)), one_head(np.ones(10)))
    assert float(comparison.w1[0, 0]) == pytest.approx(1.0 - 1 / 1000)  # bin centres 0.0005 -> 0.9995


@pytest.mark.parametrize("bins", [(1000, 100), (100, 1000), (1000, 250)], ids=["fine-coarse", "coarse-fine", "x4"])
def test_different_bin_counts_compare_on_the_coarser(bins: tuple[int, int]) -> None:
    rng = np.random.default_rng(4)
    sample_a, sample_b = rng.beta(2, 5, 3000), rng.beta(3, 3, 3000)
    comparison = compare(one_head(sample_a, num_bins=bins[0]), one_head(sample_b, num_bins=bins[1]))
    coarse = min(bins)
    assert comparison.bin_width == 1 / coarse
    assert abs(float(comparison.w1[0, 0]) - reference_w1(sample_a, sample_b)) <= 1 / coarse + 1e-4


def test_bin_counts_without_a_common_binning_are_refused() -> None:
    with pytest.raises(ValueError, match="1000 and 300 bins"):
        compare(one_head(np.full(5, 0.5), num_bins=1000), one_head(np.full(5, 0.5), num_bins=300))


def test_heads_without_data_are_nan_and_listed_last() -> None:
    values = np.full((1, 2, 4), 0.5)
    a = summary_of({"layer": values})
    metric = AttentionEntropy()  # head 1 of B only ever sees one-key queries: nothing counted
    metric.update("layer", torch.from_numpy(values * LOG_N), torch.tensor([[[NUM_VALID], [1]]]))
    b = metric.compute()
    comparison = compare(a, b)
    assert float(comparison.w1[0, 0]) == 0.0
    for name in ("w1", "mean_shift", "median_shift", "mean_b"):
        assert math.isnan(float(getattr(comparison, name)[0, 1]))
    assert float(comparison.mean_a[0, 1]) == pytest.approx(0.5)
    rows = comparison.rows()
    assert [row["head"] for row in rows] == [0, 1] and math.isnan(rows[-1]["w1"])
    table = comparison.table()
    assert "n/a" in table and "no counted query" in table


def test_rows_and_table_are_sorted_by_largest_change() -> None:
    rng = np.random.default_rng(5)
    base = rng.uniform(0.1, 0.5, size=(2, 4, 200))
    shifts = np.array([0.0, 0.3, 0.1, 0.2])[None, :, None]
    a = summary_of({"blocks.0.attn": base, "blocks.1.attn": base[:, :2]})
    b = summary_of({"blocks.0.attn": base + shifts, "blocks.1.attn": base[:, :2] + 0.05})
    comparison = compare(a, b)
    rows = comparison.rows()
    assert all(set(row) == ROW_KEYS for row in rows)
    assert len(rows) == 6, "only real heads: 4 + 2, not the padded slots"
    assert [(row["layer"], row["head"]) for row in rows[:3]] == [
        ("blocks.0.attn", 1),
        ("blocks.0.attn", 3),
        ("blocks.0.attn", 2),
    ]
    assert [row["w1"] for row in rows] == sorted((row["w1"] for row in rows), reverse=True)
    assert rows[0]["mean_shift"] == pytest.approx(0.3, abs=1e-9)
    assert rows[0]["mean_b"] - rows[0]["mean_a"] == pytest.approx(rows[0]["mean_shift"])

    lines = comparison.table(top=2).splitlines()
    assert lines[0].startswith("Normalised attention entropy") and lines[1].startswith("Sorted by W1")
    lines = lines[1:]  # index below as if the header were one line
    assert lines[1].split() == ["layer", "head", "mean", "A", "mean", "B", "mean", "shift", "median", "shift", "W1"]
    assert lines[2].split()[:2] == ["blocks.0.attn", "1"] and lines[3].split()[:2] == ["blocks.0.attn", "3"]
    assert lines[2].split()[4] == "+0.3000"
    assert lines[4] == "... 4 more head(s) with smaller W1 not shown."
    assert lines[-1] == REMINDER
    assert len(comparison.table().splitlines()) == 3 + 6 + 1
    with pytest.raises(ValueError, match="`top`"):
        comparison.table(top=0)


@pytest.mark.parametrize(
    ("layers_b", "message"),
    [
        ({"x": (1, 2), "z": (1, 2)}, r"only in A: \['y'\]; only in B: \['z'\]"),
        ({"y": (1, 2), "x": (1, 2)}, "another order"),
        ({"x": (1, 2), "y": (1, 3)}, "'y' has 2 in A, 3 in B"),
        ({"x": (1, 2)}, r"only in A: \['y'\]"),
    ],
    ids=["renamed-layer", "reordered-layers", "head-count", "missing-layer"],
)
def test_different_structures_are_refused(layers_b: dict[str, tuple[int, int]], message: str) -> None:
    a = summary_of({"x": np.full((1, 2, 3), 0.5), "y": np.full((1, 2, 3), 0.5)})
    b = summary_of({name: np.full((*shape, 3), 0.5) for name, shape in layers_b.items()})
    with pytest.raises(ValueError, match=message):
        compare(a, b)


def test_compare_rejects_other_objects() -> None:
    with pytest.raises(TypeError, match="`b`"):
        compare(one_head(np.full(3, 0.5)), "after.pt")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["w1", "mean_shift", "median_shift"])
def test_heatmap_writes_a_png(tmp_path: Path, value: str) -> None:
    import matplotlib.image

    rng = np.random.default_rng(6)
    base = rng.uniform(0.1, 0.5, size=(1, 3, 50))
    comparison = compare(
        summary_of({"l0": base, "l1": base[:, :2]}), summary_of({"l0": base - 0.05, "l1": base[:, :2] + 0.1})
    )
    # What the heatmap draws: every shift of layer 0 is -0.05, of layer 1 +0.1; layer 1 has no head 2.
    want = {"w1": (0.05, 0.1), "mean_shift": (-0.05, 0.1), "median_shift": (-0.05, 0.1)}[value]
    grid = getattr(comparison, value)
    tolerance = 1e-9 if value == "mean_shift" else 2 * comparison.bin_width
    assert grid[0].tolist() == pytest.approx([want[0]] * 3, abs=tolerance)
    assert grid[1, :2].tolist() == pytest.approx([want[1]] * 2, abs=tolerance)
    assert math.isnan(float(grid[1, 2]))
    path = tmp_path / f"{value}.png"
    comparison.heatmap(path, value=value)  # type: ignore[arg-type]
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert matplotlib.image.imread(path).ndim == 3


@pytest.mark.filterwarnings("ignore:The ``compute`` method:UserWarning")  # an empty metric, on purpose
def test_heatmap_refuses_unknown_values_and_empty_comparisons(tmp_path: Path) -> None:
    comparison = compare(one_head(np.full(3, 0.5)), one_head(np.full(3, 0.6)))
    with pytest.raises(ValueError, match="`value`"):
        comparison.heatmap(tmp_path / "x.png", value="std")  # type: ignore[arg-type]
    empty = AttentionEntropy().compute()
    with pytest.raises(ValueError, match="no layers"):
        compare(empty, empty).heatmap(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_comparison_is_immutable() -> None:
    comparison = compare(one_head(np.full(3, 0.5)), one_head(np.full(3, 0.6)))
    assert isinstance(comparison, Comparison)
    with pytest.raises(AttributeError):
        comparison.w1 = torch.zeros(1, 1)  # type: ignore[misc]


# --------------------------------------------------------------------------- command line


@pytest.fixture
def saved_pair(tmp_path: Path) -> tuple[Path, Path]:
    """Two saved summaries of 2 layers x 3 heads; head h of layer 0 shifts by 0.1 * h, layer 1 by 0.05."""
    rng = np.random.default_rng(7)
    base = rng.uniform(0.1, 0.6, size=(2, 3, 100))
    layer_shift = np.array([0.0, 0.1, 0.2])[None, :, None]
    a, b = tmp_path / "before.pt", tmp_path / "after.pt"
    save_summary(summary_of({"model.layers.0.attn": base, "model.layers.1.attn": base}), a)
    save_summary(summary_of({"model.layers.0.attn": base + layer_shift, "model.layers.1.attn": base + 0.05}), b)
    return a, b


def _table_rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["layer", "head"]) + 1
    end = lines.index(REMINDER)
    return [line.split() for line in lines[start:end]]


def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "attn_monitor", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )


def test_cli_compares_saved_files(tmp_path: Path, saved_pair: tuple[Path, Path]) -> None:
    png = tmp_path / "w1.png"
    result = _run_cli("compare", str(saved_pair[0]), str(saved_pair[1]), "--heatmap", str(png), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    rows = _table_rows(result.stdout)
    assert len(rows) == 6
    w1 = [float(row[-1]) for row in rows]
    assert w1 == sorted(w1, reverse=True)
    assert rows[0][:2] == ["model.layers.0.attn", "2"] and rows[0][4] == "+0.2000"
    assert rows[-1][:2] == ["model.layers.0.attn", "0"] and float(rows[-1][-1]) == 0.0
    assert REMINDER in result.stdout.splitlines()
    assert f"A: {saved_pair[0]} (1200 counted queries)" in result.stdout
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_cli_on_a_corrupt_file_exits_2_without_traceback(tmp_path: Path, saved_pair: tuple[Path, Path]) -> None:
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(saved_pair[1].read_bytes()[:200])
    result = _run_cli("compare", str(saved_pair[0]), str(corrupt), cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("attn-monitor: error:") and str(corrupt) in result.stderr
    assert result.stdout == ""


def test_cli_in_process_top_and_heatmap_value(
    tmp_path: Path, saved_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "shift.png"
    argv = ["compare", *map(str, saved_pair), "--top", "2", "--heatmap", str(png), "--heatmap-value", "mean_shift"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert len(_table_rows(out)) == 3  # 2 rows + the "more heads" line
    assert "... 4 more head(s)" in out and png.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["compare", "{a}", "{missing}"], "no such file"),
        (["compare", "{a}", "{other}"], "different head counts"),
        (["compare", "{a}", "{b}", "--top", "0"], "positive integer"),
        (["compare", "{a}", "{b}", "--heatmap", "{nodir}"], "cannot write the heatmap"),
        (["compare", "{a}"], "required"),
        ([], "choose a command"),
        (["frobnicate"], "invalid choice"),
    ],
    ids=["missing-file", "mismatched", "bad-top", "heatmap-unwritable", "one-file", "no-command", "unknown-command"],
)
def test_cli_errors_exit_2_with_a_message(
    tmp_path: Path,
    saved_pair: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    other = tmp_path / "other.pt"
    save_summary(
        summary_of({"model.layers.0.attn": np.full((1, 2, 3), 0.5), "model.layers.1.attn": np.full((1, 3, 3), 0.5)}),
        other,
    )
    names = {
        "a": str(saved_pair[0]),
        "b": str(saved_pair[1]),
        "missing": str(tmp_path / "missing.pt"),
        "other": str(other),
        "nodir": str(tmp_path / "no" / "such" / "dir" / "x.png"),
    }
    assert main([part.format(**names) for part in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--help"]) == 0
    assert "--heatmap" in capsys.readouterr().out
