"""`kvring bench slow-node`: what the connector decides when a cache node slows down.

One run, one local 3-node cluster, one vLLM instance in ``async`` load mode with the connector's
default deadlines and admission, on a small random Llama (recomputing a prompt takes tens of
milliseconds, so a slow node soon makes loading the slower choice).  Every prompt's first chunk
is owned by the same node.  Each prompt is computed (and saved) once; its recompute under a salt
of its own is timed in the same engine; then the prompts are sent again, one at a time, in
three phases:

- ``healthy``: every node runs;
- ``slowed``: the node is stopped (SIGSTOP) for ``stop_ms`` of every ``stop_ms + run_ms`` — long
  pauses such as a GC storm or a throttled pod — so it answers, but slowly;
- ``recovered``: it runs normally again.

Per prompt: what the connector did, read from its counters (``vllm:kvring_*``) before and after
the prompt (``kvring.engine.run.decision_between``) — ``loaded`` (or ``loaded (probe)``),
``abandoned`` (the load overran its deadline; its blocks recomputed), ``load failed``,
``refused (slower)`` (admission predicted recomputing faster), ``refused (node_failing)`` (the
node failed a load and no probe has succeeded since), ``lookup past deadline`` (a miss) — the
tokens it loaded, its time to first token and that prompt's recompute time.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvring.bench.report import write_outputs
from kvring.engine.run import decision_between
from kvring.local.cluster import LocalCluster
from kvring.local.rundir import run_directory

PHASES = ("healthy", "slowed", "recovered")
STEP_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class SlowNodeSettings:
    prompts_per_phase: tuple[int, int, int] = (4, 12, 12)
    tokens: int = 1024
    stop_ms: float = 300.0  # the slowed node is stopped this long ...
    run_ms: float = 30.0  # ... then runs this long, over and over
    lookup_deadline_ms: float | None = None  # the connector's setting (None: its default)
    layers: int = 4
    hidden: int = 512
    intermediate: int = 1376
    heads: int = 8
    kv_heads: int = 4
    memory: int = 512 << 20
    tls: bool = True  # the data plane as `kvring up` runs it (mutual TLS); False: plain TCP

    @classmethod
    def quick(cls) -> SlowNodeSettings:
        return cls(prompts_per_phase=(2, 4, 3), tokens=512, layers=2, hidden=256, intermediate=512, heads=4,
                   kv_heads=2, memory=128 << 20)


class Throttle:
    """Stop and continue a process over and over (SIGSTOP ``stop_s``, SIGCONT ``run_s``) until ``stop()``."""

    def __init__(self, pid: int, stop_s: float, run_s: float) -> None:
        self.pid, self.stop_s, self.run_s = pid, stop_s, run_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvring-throttle", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(self.stop_s)
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(self.run_s)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _placed_prompts(layout, client, n: int, tokens: int, node: str, seed: int) -> list[list[int]]:
    """``n`` random prompts the first part of whose first chunk ``node`` owns (no two share a chunk)."""
    from kvring.connector.keys import request_keys

    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        p = rng.integers(10, 2000, size=tokens).tolist()
        if client.owners(layout.parts().parts[0].key(request_keys(layout, p)[0]))[0] == node:
            out.append(p)
    return out


def run_bench_slow_node(settings: SlowNodeSettings = SlowNodeSettings(), json_out: Path | None = None,
                        plot: Path | None = None) -> dict:
    from kvring.cachenode.client import ClusterClient
    from kvring.engine.run import layout_of, start_instance, write_tiny_llama

    s = settings
    console = Console(width=None if Console().is_terminal else 160)
    instance, throttle = None, None
    # The model, the instances' logs and every file vLLM and torch write: removed however the run ends.
    with run_directory("bench-slow-node") as tmp:
        try:
            with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                          TimeElapsedColumn(), console=console) as bar:
                task = bar.add_task("writing a random Llama (no download)", total=3 + len(PHASES))
                model = str(write_tiny_llama(tmp / "model", layers=s.layers, hidden=s.hidden, heads=s.heads,
                                             kv_heads=s.kv_heads, intermediate=s.intermediate))
                bar.advance(task)
                bar.update(task, description="starting etcd and 3 cache nodes")
                with LocalCluster(nodes=3, memory=s.memory, cluster="bench-slow-node", tls=s.tls) as cluster:
                    victim = cluster.nodes[0]
                    with ClusterClient(cluster.etcd, cluster=cluster.cluster, tls=cluster.tls) as client:
                        client.wait_for_nodes(3)
                        layout = layout_of({"model": model}, client.contract.chunk_size)
                        prompts = _placed_prompts(layout, client, sum(s.prompts_per_phase), s.tokens,
                                                  victim.node_id, seed=5)
                    bar.advance(task)
                    bar.update(task, description="starting vLLM, computing and recomputing every prompt")
                    steps: list[dict] = [{"tokens": list(range(100, 400)), "salt": "warm-up"},
                                         {"batch": [{"tokens": p} for p in prompts]}]
                    steps += [{"tokens": p, "salt": f"recompute-{i}"} for i, p in enumerate(prompts)]
                    i = 0
                    for phase, n in zip(PHASES, s.prompts_per_phase):
                        steps += [{"touch": str(tmp / f"{phase}-ready")},
                                  {"wait_for": str(tmp / f"{phase}-go"), "timeout": STEP_TIMEOUT_S}]
                        steps += [{"tokens": p} for p in prompts[i:i + n]]
                        i += n
                    conn = cluster.connector(load_mode="async")
                    if s.lookup_deadline_ms is not None:
                        conn["lookup_deadline_ms"] = s.lookup_deadline_ms
                    spec = {"model": model, "max_tokens": 1, "prompts": steps, "connector": conn}
                    (tmp / "vllm-tmp").mkdir()
                    instance = start_instance(tmp, "engine", spec, tmpdir=tmp / "vllm-tmp")
                    for phase in PHASES:
                        instance.wait_file(tmp / f"{phase}-ready", STEP_TIMEOUT_S)
                        if throttle is not None:
                            throttle.stop()
                            throttle = None
                        if phase == "slowed":
                            throttle = Throttle(victim.pid, s.stop_ms / 1000, s.run_ms / 1000)
                        bar.advance(task)
                        bar.update(task, description=f"phase {phase!r}")
                        (tmp / f"{phase}-go").touch()
                    out = instance.result(timeout=STEP_TIMEOUT_S)
                    bar.advance(task)
        finally:
            if throttle is not None:
                throttle.stop()
            if instance is not None:
                instance.stop()

    results = _results(s, out)
    console.print(_table(results))
    write_outputs(console, results, json_out, plot, _plot)
    return results


def _results(s: SlowNodeSettings, out: dict) -> dict:
    n = sum(s.prompts_per_phase)
    res, steps = out["results"], out["steps"]
    # results: warm-up, the batch (one per prompt), the recomputes, the phases' prompts;
    # steps (generate calls): warm-up, the batch, one per recompute, one per phase prompt.
    computed, recomputes, phase_runs = res[1:1 + n], res[1 + n:1 + 2 * n], res[1 + 2 * n:]
    counters = [st["counters"] for st in steps]
    rows, i = [], 0
    for phase, count in zip(PHASES, s.prompts_per_phase):
        for _ in range(count):
            r = phase_runs[i]
            before, after = counters[2 + n + i - 1], counters[2 + n + i]
            rows.append({"phase": phase, "prompt": i, "decision": decision_between(before, after), "loaded": r["cached"],
                         "ttft": r["ttft"], "recompute_ttft": recomputes[i]["ttft"],
                         "same_tokens": r["tokens"] == computed[i]["tokens"]})
            i += 1
    summary = {}
    for phase in PHASES:
        mine = [r for r in rows if r["phase"] == phase]
        summary[phase] = {"decisions": {d: sum(1 for r in mine if r["decision"] == d)
                                        for d in sorted({r["decision"] for r in mine})},
                          "median_ttft": statistics.median(r["ttft"] for r in mine),
                          "median_recompute_ttft": statistics.median(r["recompute_ttft"] for r in mine)}
    return {"settings": {"tokens": s.tokens, "stop_ms": s.stop_ms, "run_ms": s.run_ms, "layers": s.layers,
                         "lookup_deadline_ms": s.lookup_deadline_ms, "tls": s.tls,
                         "hidden": s.hidden, "prompts_per_phase": list(s.prompts_per_phase)},
            "rows": rows, "summary": summary, "all_same_tokens": all(r["same_tokens"] for r in rows)}


def _table(results: dict) -> Table:
    st = results["settings"]
    deadline = "the default" if st["lookup_deadline_ms"] is None else f"{st['lookup_deadline_ms']:.0f} ms"
    table = Table(title=f"kvring bench slow-node: async loads, {st['tokens']}-token prompts, "
                        f"{st['layers']}-layer hidden-{st['hidden']} Llama on CPU; slowed = the owner stopped "
                        f"{st['stop_ms']:.0f} ms of every {st['stop_ms'] + st['run_ms']:.0f} ms; lookup deadline "
                        f"{deadline}; {'mutual TLS' if st['tls'] else 'plain TCP'}")
    for col in ("phase", "prompt", "decision", "tokens loaded", "TTFT", "its recompute", "tokens = computed"):
        table.add_column(col, justify="right")
    for r in results["rows"]:
        table.add_row(r["phase"], str(r["prompt"]), r["decision"], str(r["loaded"]), f"{r['ttft'] * 1000:.0f} ms",
                      f"{r['recompute_ttft'] * 1000:.0f} ms", "yes" if r["same_tokens"] else "NO")
    return table


def _plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    colors = {"loaded": "tab:green", "loaded (probe)": "tab:olive", "load failed": "tab:pink",
              "refused (slower)": "tab:orange", "refused (node_failing)": "tab:brown",
              "abandoned": "tab:red",
              "lookup past deadline": "tab:purple", "miss": "tab:gray"}
    fig, ax = plt.subplots(figsize=(8, 4))
    for d, color in colors.items():
        xs = [r["prompt"] for r in rows if r["decision"] == d]
        if xs:
            ax.scatter(xs, [r["ttft"] * 1000 for r in rows if r["decision"] == d], color=color, label=d)
    ax.plot([r["prompt"] for r in rows], [r["recompute_ttft"] * 1000 for r in rows], color="black",
            linestyle=":", label="its recompute")
    for phase in PHASES[1:]:
        first = next(r["prompt"] for r in rows if r["phase"] == phase)
        ax.axvline(first - 0.5, color="gray", linewidth=0.8)
        ax.text(first - 0.4, ax.get_ylim()[1] * 0.95, phase, fontsize=8, va="top")
    ax.set_xlabel("prompt (in order)")
    ax.set_ylabel("time to first token, ms")
    ax.set_title("Async loads while one node is slowed: what the connector decided")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
