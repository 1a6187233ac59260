"""What placing heads (tensor parallelism support) costs a monitored forward that is not parallel.

Every recorded call passes through :func:`attn_monitor.capture.parallel.place_heads`,
which looks the layer's module up and reads its parameters for DTensor
shards. This measures, on a Llama-style model (4 layers, hidden 256, 8
heads, batch 2, float32 on CPU, eval, no gradients):

* **forward**: one monitored forward with the placement, and with the
  placement replaced by the identity, interleaved; medians and ranges;
* **per call**: ``place_heads`` alone on one recorded call, for plain
  weights and for weights that are DTensors on a one-rank device mesh
  (every placement read; none shards).

    python benchmarks/bench_parallel.py [--sizes 256 1024] [--repeats 15] [--threads T]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import cpu_model
from torch import Tensor, nn

from attn_monitor.capture import hooks as capture_module
from attn_monitor.capture.calls import AttentionCall
from attn_monitor.capture.hooks import AttentionCapture
from attn_monitor.capture.parallel import place_heads
from attn_monitor.functional.masks import Support

BATCH, LAYERS, HIDDEN, HEADS = 2, 4, 256, 8


class LlamaStyleAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        q, k, v = (
            p(x).view(batch, seq, -1, HIDDEN // HEADS).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(LlamaStyleAttention() for _ in range(LAYERS))).eval()


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _forward_ms(size: int, repeats: int) -> dict[str, list[float]]:
    model, x = _model(), torch.randn(BATCH, size, HIDDEN)
    times: dict[str, list[float]] = {"placed": [], "identity": []}
    with AttentionCapture(model) as attention, torch.no_grad():

        def placed() -> None:
            with attention.recording():
                model(x)

        def identity() -> None:
            with mock.patch.object(capture_module, "place_heads", lambda call, _: call), attention.recording():
                model(x)

        placed(), identity()  # warm-up
        for _ in range(repeats):
            times["placed"].append(_timed(placed) * 1e3)
            times["identity"].append(_timed(identity) * 1e3)
    return times


def _per_call_us(model: nn.Module, repeats: int = 2000) -> float:
    q = torch.randn(BATCH, HEADS, 64, HIDDEN // HEADS)
    call = AttentionCall("0", Support(64, 64, causal=True), q=q, k=q)
    place_heads(call, model)
    start = time.perf_counter()
    for _ in range(repeats):
        place_heads(call, model)
    return (time.perf_counter() - start) / repeats * 1e6


def _dtensor_model() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1,))
    plan = {f"{i}.{name}": ColwiseParallel() for i in range(LAYERS) for name in ("q_proj", "k_proj", "v_proj")}
    plan.update({f"{i}.o_proj": RowwiseParallel() for i in range(LAYERS)})
    return parallelize_module(_model(), mesh, plan)  # type: ignore[arg-type]


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}, torch {torch.__version__}, {args.threads} thread(s)\n")
    print("| N | forward ms, placed | forward ms, identity | ratio of medians |")
    print("|---|---|---|---|")
    for size in args.sizes:
        times = _forward_ms(size, args.repeats)
        ratio = statistics.median(times["placed"]) / statistics.median(times["identity"])
        print(f"| {size} | {_spread(times['placed'])} | {_spread(times['identity'])} | {ratio:.3f} |")
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=0, world_size=1)
        try:
            plain, sharded = _per_call_us(_model()), _per_call_us(_dtensor_model())
        finally:
            dist.destroy_process_group()
    print(f"\nplace_heads per call: plain weights {plain:.1f} us, DTensor weights (one-rank mesh) {sharded:.1f} us")


if __name__ == "__main__":
    main()
