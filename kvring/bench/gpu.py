"""`kvring bench gpu`: the connector's CUDA copies next to plain pinned copies, and what a
layerwise load costs the forward pass it runs under.

One process on one CUDA device, a Llama-3.1-8B-shaped KV cache: 32 layers, 8 KV heads of 128
(a token's K|V per head: 256 values), bfloat16, block size 16.  Each layer's cache is the
``[blocks, KV heads, block size, K|V]`` view vLLM 0.32 hands connectors, strided over one
allocation as vLLM lays it out (``--layout``; default LBNHC, the NHD layout FlashAttention gets on
an H100).  A step moves ``chunks`` chunks of 256 tokens (16: 4,096 tokens, 512 MiB) from and to
randomly placed blocks.

Every repetition runs each case once, interleaved (their order reversed every other repetition),
after a warm-up repetition whose copies are checked byte for byte (``--budget S``: no repetition
starts after S seconds, once two are in):

- load: the chunks' parts (one per KV head, layer-major ``[layers, tokens, 1, K|V]``) already in
  plain host memory, as the cluster client hands them over from the socket, scattered layer by
  layer into the paged blocks by ``CudaCopies.load`` and ``layer_loaded`` (the worker's copy:
  frames staged into reused pinned buffers, per layer one host-to-device copy and one scatter
  kernel on a side stream); the same through ``WorkerSide`` (a layerwise load on its own thread,
  from a stand-in client that serves the parts from host memory instead of the network); next to
  one pinned ``copy_(non_blocking=True)`` per layer of the same bytes into a contiguous device
  buffer, and one from pageable memory;
- save: the same tokens gathered out of the blocks by ``CudaCopies.gather_into`` into save buffers
  allocated as ``save_kv_layer`` allocates them (``new_save_buffer``: one per chunk and head, carved
  out of pinned slabs), per layer and head one gather kernel and one pitched copy, until they landed;
  next to one pinned device-to-host ``copy_`` per layer;
- overlap: a stand-in forward of the layers on ``tokens`` new tokens (per layer an 8B layer's QKV,
  output, gate/up and down projections and causal GQA attention), alone and with the layerwise
  ``WorkerSide`` load running (``wait_for_layer_load`` before each layer, as vLLM calls it).

Reported: GB/s (bytes moved / wall seconds from the first call until the copies landed) and
forward seconds, medians with their spread, and the ratios the targets are stated in: loads and
saves at least 0.8x the pinned copy, the forward with the load at most 1.10x the forward alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvring.bench.report import machine, spread, summary, write_outputs
from kvring.cachenode.client import LayerBatch
from kvring.common.errors import KVRingError
from kvring.connector.config import ConnectorConfig
from kvring.connector.copies import buffer_runs, copies_for, slot_runs
from kvring.connector.metadata import KVRingMetadata, LoadSpec, ReqMeta
from kvring.connector.cache_layouts import LAYOUTS, vllm_views
from kvring.connector.worker import WorkerSide

CASES = ("load CudaCopies.load", "load WorkerSide layerwise", "load pinned copy_", "load pageable copy_",
         "save CudaCopies.gather_into", "save pinned copy_", "forward alone", "forward + layerwise load")
TARGETS = {"load": 0.8, "save": 0.8, "forward": 1.10}


class GpuBenchError(KVRingError):
    """The bench cannot run here (no CUDA device) or its copies came out wrong."""


@dataclass(frozen=True)
class GpuSettings:
    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    chunk: int = 256  # tokens per chunk (the cluster's default chunk size)
    chunks: int = 16  # chunks per step
    layout: str = "LBNHC"
    # The stand-in forward: Llama-3.1-8B's layer widths, on this many new tokens.
    tokens: int = 4096
    hidden: int = 4096
    q_heads: int = 32
    intermediate: int = 14336
    repetitions: int = 7
    # Stop repeating once this many seconds went by (after at least 2 repetitions; 0: no limit).
    budget_s: float = 0.0

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r} is not one of vLLM's: {', '.join(LAYOUTS)}")
        for name in ("layers", "kv_heads", "head_size", "block_size", "chunk", "chunks", "tokens", "hidden",
                     "q_heads", "intermediate", "repetitions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.budget_s < 0:
            raise ValueError(f"budget_s must be 0 (no limit) or positive seconds, got {self.budget_s}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"{self.q_heads} query heads cannot share {self.kv_heads} KV heads evenly")

    @classmethod
    def quick(cls) -> GpuSettings:
        """A small run (seconds): for tests, not for figures."""
        return cls(layers=4, chunks=2, tokens=512, hidden=1024, q_heads=8, intermediate=2048, repetitions=2)

    @property
    def channels(self) -> int:
        return 2 * self.head_size  # K|V of one head

    @property
    def step_bytes(self) -> int:
        """Bytes a step loads (and saves): every layer and head of every chunk's tokens."""
        return self.layers * self.chunks * self.chunk * self.kv_heads * self.channels * 2



class HostParts:
    """Stands in for the cluster client's reads: serves each part's layers from host memory, one
    ``LayerBatch`` per layer, as ``ClusterClient.iter_layers`` hands them over from the socket."""

    def __init__(self, parts: dict[bytes, np.ndarray]) -> None:
        self.parts = parts  # part key -> its layers, [layers, bytes per layer]

    def iter_layers(self, keys, layers=None, found=None, meter=None, place=None):
        """(``place`` is not used: the parts are in this process's memory already, and the copy
        into the cache is what this bench measures; a client may always deliver a view.)"""
        arrays = [self.parts[k] for k in keys]
        if found is not None:
            found[:] = [True] * len(keys)  # every part is there (a real read stores its ChunkMeta)
        for layer in range(arrays[0].shape[0]):
            yield LayerBatch(layer, list(range(len(keys))), [memoryview(a[layer]) for a in arrays])


class StandInForward:
    """Per layer, what an 8B layer computes for ``tokens`` new tokens: QKV, causal GQA attention,
    output, gate/up and down projections (one set of random weights serves every layer)."""

    def __init__(self, s: GpuSettings, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(0)

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=g, device=device, dtype=torch.bfloat16) / rows ** 0.5

        self.s = s
        self.qkv = weight(s.hidden, (s.q_heads + 2 * s.kv_heads) * s.head_size)
        self.out = weight(s.q_heads * s.head_size, s.hidden)
        self.gate_up = weight(s.hidden, 2 * s.intermediate)
        self.down = weight(s.intermediate, s.hidden)
        self.x = torch.randn(s.tokens, s.hidden, generator=g, device=device, dtype=torch.bfloat16)

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        s, t = self.s, x.shape[0]
        q, k, v = (F.rms_norm(x, (s.hidden,)) @ self.qkv).split(
            [s.q_heads * s.head_size, s.kv_heads * s.head_size, s.kv_heads * s.head_size], dim=-1)
        q, k, v = (y.view(t, -1, s.head_size).transpose(0, 1).unsqueeze(0) for y in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + attn[0].transpose(0, 1).reshape(t, -1) @ self.out
        gate, up = (F.rms_norm(x, (s.hidden,)) @ self.gate_up).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.down


class Step:
    """One step's data and the cases that move it (each returns its wall seconds)."""

    def __init__(self, s: GpuSettings, device: torch.device) -> None:
        self.s, self.device = s, device
        bs, ch, heads, n = s.block_size, s.channels, s.kv_heads, s.chunks * s.chunk
        blocks = 2 * -(-n // bs)
        rng = np.random.default_rng(0)
        raw = torch.zeros(s.layers * blocks * heads * bs * ch, dtype=torch.bfloat16, device=device)
        self.caches = {f"model.layers.{i}.self_attn.attn": view
                       for i, view in enumerate(vllm_views(raw, s.layers, blocks, heads, bs, ch, s.layout))}
        self.block_ids = rng.permutation(blocks)[:-(-n // bs)]
        self.slots = self.block_ids[np.arange(n) // bs] * bs + np.arange(n) % bs
        # The parts as they arrive: per chunk and head, layer-major [layers, tokens * 1 * K|V] bytes.
        layer_bytes = s.chunk * ch * 2
        self.host = rng.integers(0, 256, (s.chunks, heads, s.layers, layer_bytes), dtype=np.uint8)
        self.keys = [b"kvring-bench-gpu-%06d" % c for c in range(s.chunks)]
        self.head_views = [[kv[:, j:j + 1] for j in range(heads)] for kv in self.caches.values()]
        self.load_runs = [slot_runs(self.slots[c * s.chunk:(c + 1) * s.chunk], bs) for c in range(s.chunks)]
        self.save_runs = buffer_runs(self.slots, bs, [s.chunk] * s.chunks)
        # The plain copies' buffers: the same bytes, one contiguous piece per layer.
        flat = self.host.reshape(s.layers, -1)
        self.pageable = torch.from_numpy(flat)
        pin = device.type == "cuda"
        self.pinned = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=pin)
        self.pinned.copy_(self.pageable)
        self.pinned_out = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=pin)
        self.device_buf = torch.empty(flat.shape, dtype=torch.uint8, device=device)
        self.copies = copies_for(raw, bs)  # CudaCopies on a CUDA device, as the worker's
        self.bufs: list[list[torch.Tensor]] = []
        self.forward = StandInForward(s, device)
        config = ConnectorConfig(etcd="host-memory", cluster="bench-gpu", load_mode="layerwise")
        served = HostParts({})
        self.worker = WorkerSide(config, served, s.chunk, bs)
        self.worker.register_kv_caches(self.caches)
        served.parts.update({wp.part.key(key): self.host[c, wp.head]
                             for c, key in enumerate(self.keys) for wp in self.worker.parts})
        load = LoadSpec(self.keys, start=0, write_from=0, end=n)
        self.meta = KVRingMetadata([ReqMeta("bench", self.slots, self.block_ids.tolist(), load=load)])

    def _timed(self, body: Callable[[], None]) -> float:
        """Wall seconds of ``body`` until the device has finished what it issued."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        body()
        if cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def load(self) -> float:
        def body() -> None:
            self.copies.reset()
            for layer, views in enumerate(self.head_views):
                for c, runs in enumerate(self.load_runs):
                    for h, view in enumerate(views):
                        self.copies.load(view, runs, memoryview(self.host[c, h, layer]), 0)
                self.copies.layer_loaded(layer)
            self.copies.synchronize()
        return self._timed(body)

    def worker_load(self, forward: bool = False) -> float:
        def body() -> None:
            self.worker.start_load_kv(self.meta)
            x = self.forward.x
            for name in self.caches:
                self.worker.wait_for_layer_load(name)
                if forward:
                    x = self.forward.layer(x)
            failed = self.worker.get_block_ids_with_load_errors()
            if failed:
                raise GpuBenchError(f"the layerwise load failed {len(failed)} blocks")
        return self._timed(body)

    def forward_alone(self) -> float:
        def body() -> None:
            x = self.forward.x
            for _ in self.caches:
                x = self.forward.layer(x)
        return self._timed(body)

    def plain(self, src: torch.Tensor, dst: torch.Tensor) -> float:
        def body() -> None:
            for layer in range(self.s.layers):
                dst[layer].copy_(src[layer], non_blocking=True)
        return self._timed(body)

    def save(self) -> float:
        s = self.s

        def body() -> None:
            self.bufs = []  # the last step's buffers go back to the pinned cache, as a finished save's do
            self.bufs = [[self.copies.new_save_buffer((s.layers, s.chunk, 1, s.channels), torch.bfloat16)
                          for _ in range(s.chunks)] for _ in range(s.kv_heads)]
            for layer, views in enumerate(self.head_views):
                for h, view in enumerate(views):
                    self.copies.gather_into(view, self.save_runs, self.bufs[h], layer)
            self.copies.wait_saved(self.copies.saved())
        return self._timed(body)

    def cases(self) -> dict[str, Callable[[], float]]:
        """``CASES``, each with what runs it."""
        return dict(zip(CASES, (
            self.load,
            self.worker_load,
            lambda: self.plain(self.pinned, self.device_buf),
            lambda: self.plain(self.pageable, self.device_buf),
            self.save,
            lambda: self.plain(self.device_buf, self.pinned_out),
            self.forward_alone,
            lambda: self.worker_load(forward=True),
        ), strict=True))

    def check(self) -> None:
        """Every byte loaded went to its slots and came back out of them unchanged."""
        s, bs = self.s, self.s.block_size
        first = torch.as_tensor(self.slots[:s.chunk])
        direct = self.head_views[0][0][first // bs, 0, first % bs].cpu().view(torch.uint8).numpy()
        if not np.array_equal(direct.reshape(-1), self.host[0, 0, 0]):
            raise GpuBenchError("layer 0 of chunk 0's first head is not where its slots are")
        for h, bufs in enumerate(self.bufs):
            for c, buf in enumerate(bufs):
                if not np.array_equal(buf.view(torch.uint8).numpy().reshape(s.layers, -1), self.host[c, h]):
                    raise GpuBenchError(f"chunk {c}, head {h}: the saved bytes differ from the loaded ones")

    def close(self) -> None:
        self.worker.shutdown()


def _measure(s: GpuSettings, device: torch.device, console: Console) -> tuple[dict[str, list[float]], dict]:
    step = Step(s, device)
    try:
        cases = step.cases()
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        started = time.monotonic()
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("warm-up, then interleaved repetitions", total=s.repetitions + 1)
            for case in cases.values():  # warm-up: first allocations, kernels, the pinned cache
                case()
            step.check()
            progress.advance(task)
            for rep in range(s.repetitions):
                if s.budget_s and rep >= 2 and time.monotonic() - started > s.budget_s:
                    break
                for name in (list(cases) if rep % 2 == 0 else list(cases)[::-1]):
                    seconds[name].append(cases[name]())
                progress.advance(task)
        step.check()
        last = step.worker.loads[-1]
        return seconds, {"first_layer_seconds": last["first_layer_seconds"], "parts": last["parts"]}
    finally:
        step.close()


def run_bench_gpu(settings: GpuSettings, json_out: Path | None = None, plot: Path | None = None,
                  console: Console | None = None) -> dict:
    if not torch.cuda.is_available():
        raise GpuBenchError(f"kvring bench gpu needs a CUDA device; torch {torch.__version__} sees none here "
                            "(torch.cuda.is_available() is False)")
    console = console or Console(width=150)
    s = settings
    device = torch.device("cuda", torch.cuda.current_device())
    seconds, worker = _measure(s, device, console)
    repetitions = len(seconds[CASES[0]])
    nbytes = s.step_bytes
    gbps = {name: summary([nbytes / t / 1e9 for t in ts]) for name, ts in seconds.items()
            if not name.startswith("forward")}
    times = {name: summary(ts) for name, ts in seconds.items()}
    med = {name: statistics.median(ts) for name, ts in seconds.items()}
    ratios = {
        "load / pinned": med["load pinned copy_"] / med["load CudaCopies.load"],
        "layerwise load / pinned": med["load pinned copy_"] / med["load WorkerSide layerwise"],
        "save / pinned": med["save pinned copy_"] / med["save CudaCopies.gather_into"],
        "forward with load / alone": med["forward + layerwise load"] / med["forward alone"],
    }
    met = {"load": ratios["load / pinned"] >= TARGETS["load"], "save": ratios["save / pinned"] >= TARGETS["save"],
           "forward": ratios["forward with load / alone"] <= TARGETS["forward"]}
    props = torch.cuda.get_device_properties(device)
    results = {
        "settings": asdict(s), "device": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
        "machine": machine(), "repetitions": repetitions, "step_bytes": nbytes, "seconds": seconds,
        "times": times, "gbps": gbps, "ratios": ratios, "targets": TARGETS, "met": met, "worker_load": worker,
    }
    title = (f"kvring bench gpu on {props.name}: {s.layers} layers x {s.kv_heads} KV heads x {s.head_size} bf16, "
             f"block {s.block_size}, {s.layout}; {s.chunks} chunks of {s.chunk} tokens ({nbytes / 2**20:.0f} MiB) a "
             f"step; median of {repetitions} interleaved repetitions (min-max)")
    table = Table(title=title)
    for col in ("case", "seconds", "GB/s", "vs pinned copy_"):
        table.add_column(col, justify="right")
    for name in seconds:
        rate = spread(gbps[name], ".1f") if name in gbps else ""
        pinned = ("load pinned copy_" if name.startswith("load") else "save pinned copy_" if name.startswith("save")
                  else None)
        vs = f"{med[pinned] / med[name]:.2f}x" if pinned else ""
        if name == "forward + layerwise load":
            vs = f"{ratios['forward with load / alone']:.2f}x the forward alone"
        table.add_row(name, spread(times[name], ".4f"), rate, vs)
    console.print(table)
    console.print(f"targets: load >= {TARGETS['load']}x pinned ({'met' if met['load'] else 'missed'}), "
                  f"save >= {TARGETS['save']}x pinned ({'met' if met['save'] else 'missed'}), forward with the load "
                  f"<= {TARGETS['forward']}x alone ({'met' if met['forward'] else 'missed'}); the layerwise load's "
                  f"first layer was in after {worker['first_layer_seconds']:.4f} s; {machine()}; torch "
                  f"{torch.__version__}, CUDA {torch.version.cuda}")
    write_outputs(console, results, json_out, plot, _draw)
    return results


def _draw(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rates, forward) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    names = list(res["gbps"])
    meds = [res["gbps"][n]["median"] for n in names]
    errs = [[m - res["gbps"][n]["min"] for n, m in zip(names, meds)],
            [res["gbps"][n]["max"] - m for n, m in zip(names, meds)]]
    colors = ["tab:blue" if n.startswith("load") else "tab:orange" for n in names]
    rates.bar(range(len(names)), meds, yerr=errs, color=colors, capsize=3)
    rates.set_xticks(range(len(names)), [n.replace(" ", "\n", 1).replace(".", ".\n", 1) for n in names], fontsize=7)
    rates.set_ylabel("GB/s (median, min-max)")
    rates.set_title("host to device (load), device to host (save)")
    fnames = [n for n in CASES if n.startswith("forward")]
    fmeds = [res["times"][n]["median"] * 1e3 for n in fnames]
    forward.bar(range(2), fmeds, color=["tab:gray", "tab:green"])
    forward.set_xticks(range(2), ["alone", "with layerwise\nload"], fontsize=8)
    forward.set_ylabel("ms (median)")
    forward.set_title(f"stand-in forward: {res['ratios']['forward with load / alone']:.2f}x")
    s = res["settings"]
    fig.suptitle(f"kvring bench gpu: {res['device']}, {s['layers']}x{s['kv_heads']}x{s['head_size']} bf16 cache "
                 f"({s['layout']}), {s['chunks']} chunks of {s['chunk']} tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> tuple[GpuSettings, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="python -m kvring.bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json-out", "--json", type=Path, help="Write results as JSON.")
    parser.add_argument("--plot", type=Path, help="Write a PNG plot.")
    parser.add_argument("--chunks", type=int, help=f"Chunks of 256 tokens a step moves (default {GpuSettings.chunks}).")
    parser.add_argument("--tokens", type=int,
                        help=f"New tokens of the stand-in forward (default {GpuSettings.tokens}).")
    parser.add_argument("--layout", choices=list(LAYOUTS),
                        help=f"vLLM's physical KV cache layout (default {GpuSettings.layout}, NHD: FlashAttention's; "
                             "LBHNC: HND).")
    parser.add_argument("--repetitions", type=int,
                        help=f"Interleaved repetitions after the warm-up (default {GpuSettings.repetitions}).")
    parser.add_argument("--budget", type=float, dest="budget_s",
                        help="Stop repeating after this many seconds (at least 2 repetitions; default: no limit).")
    parser.add_argument("--quick", action="store_true", help="A small model and step (seconds), for tests.")
    args = parser.parse_args(argv)
    given = {name: getattr(args, name) for name in ("chunks", "tokens", "layout", "repetitions", "budget_s")
             if getattr(args, name) is not None}
    try:
        settings = GpuSettings(**{**asdict(GpuSettings.quick() if args.quick else GpuSettings()), **given})
    except ValueError as exc:
        parser.error(str(exc))
    return settings, args


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_args(argv)
    try:
        run_bench_gpu(settings, args.json_out, args.plot)
    except KVRingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
