"""`kvring bench miss`: never slower than a miss — what the connector costs when nothing hits.

One run, one local 3-node cluster and two vLLM instances (each its own process) with the same
engine configuration on the same random Llama (by default bench e2e's: 6 layers, hidden 1024,
GQA 8/4 heads of 128, MLP 11008), one with KVRingConnector and one without any connector.
Both start once and stay up; each repetition sends both the same fresh batch of new prompts
(by default 32 of 1,024 random tokens, in one generate call), one engine after the other, the
order alternating between repetitions.  Every prompt is new to the cluster — no two share a
chunk, and none repeats one of an earlier repetition or of the warm-up — so every lookup
misses: the connector engine pays for its lookups, its scheduler hooks and its saves, and
loads nothing.

Measured per repetition and engine: the batch's wall time and prompt tokens per second; for
the connector engine, from vLLM's Prometheus counters (``vllm:kvring_*_total``, read in the
instance's process): the seconds its scheduler-side hooks held vLLM's scheduler loop
(``scheduler_hook_seconds``), as a share of the batch's wall time, the lookups it sent, those
past their deadline (which make a request wait that long and then recompute), and what it
saved (saves finish in the background, so a batch's count may include the end of the one
before it).  Reported: medians over the repetitions and their spread (min-max).

Threads: vLLM's CPU build binds a worker's OpenMP threads itself (``VLLM_CPU_OMP_THREADS_BIND=
auto``) and keeps cores back for the scheduler process: one, and one more when any KV connector
is configured (``vllm/utils/ompmultiprocessing.py``, "reserve one more core for nixl_connector").
So, left to vLLM, the two engines would not compute with the same threads (on a 2-core machine:
one without a connector, both with one, as nothing is reserved when all would be).  By default
(``omp_bind="same"``) both engines get the same explicit binding, every CPU this process may
run on, so the comparison is of the connector alone; ``omp_bind="vllm"`` measures vLLM's own
binding instead.  A ``VLLM_CPU_OMP_THREADS_BIND`` already set in the environment is kept.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvring.bench.report import grouped_bars, spread, summary, write_outputs
from kvring.local.cluster import LocalCluster
from kvring.local.rundir import run_directory

ENGINES = ("no connector", "kvring")  # the JSON's and the table's names for the two instances
COUNTERS = ("scheduler_hook_seconds", "lookups", "lookups_past_deadline", "lookup_errors", "queried_tokens",
            "hit_tokens", "saved_parts", "saved_bytes", "failed_saves")
STEP_TIMEOUT_S = 1800.0  # a batch (or an engine start) that takes longer than this is a hang
OMP_BINDS = ("same", "vllm")
# After a batch, an engine's processes keep spinning on vLLM's shared-memory message queues for
# a second (``busy_loop_s`` in vllm/distributed/device_communicators/shm_broadcast.py), on the
# cores the other engine computes on: each batch starts only once the previous one's engine is idle.
SETTLE_S = 1.5


@dataclass(frozen=True)
class MissSettings:
    """What one `kvring bench miss` run measures (the command line builds it)."""

    prompts: int = 32  # prompts per batch (one generate call)
    tokens: int = 1024  # tokens per prompt
    repetitions: int = 3  # batches per engine, alternating engines
    warmup_prompts: int = 8  # a first batch per engine, not measured (first-call costs)
    layers: int = 6
    hidden: int = 1024
    intermediate: int = 11008
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 32000
    memory: int = 2 << 30  # cache budget per node
    omp_bind: str = "same"  # "same": both engines' threads on every allowed CPU; "vllm": vLLM's auto binding
    tls: bool = True  # the data plane as `kvring up` runs it (mutual TLS); False: plain TCP

    def __post_init__(self) -> None:
        if self.omp_bind not in OMP_BINDS:
            raise ValueError(f"omp_bind must be one of {OMP_BINDS}, got {self.omp_bind!r}")

    @classmethod
    def quick(cls, omp_bind: str = "same") -> MissSettings:
        """The smallest meaningful run (for smoke tests): a 2-layer toy model, 2 batches of 8 x 512."""
        return cls(prompts=8, tokens=512, repetitions=2, warmup_prompts=2, layers=2, hidden=256,
                   intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=2048, memory=256 << 20,
                   omp_bind=omp_bind)


def _thread_binding(omp_bind: str) -> dict[str, str]:
    """The environment both engines start with: one OpenMP binding for both (see the module docstring)."""
    if omp_bind == "vllm" or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))}


def _prompts(s: MissSettings, first_id: int, n: int, seed: int) -> list[list[int]]:
    """``n`` random prompts of ``s.tokens`` tokens; the first two tokens spell a unique id.

    Ids never repeat within a run, so no two prompts share their first chunk, and as chunk keys
    are chained over the whole prefix, no two share any chunk.
    """
    rng = np.random.default_rng(seed)
    base = s.vocab - 10
    out = []
    for i in range(first_id, first_id + n):
        tokens = rng.integers(10, s.vocab, size=s.tokens)
        tokens[0], tokens[1] = 10 + i // base, 10 + i % base
        out.append(tokens.tolist())
    return out


def _spec(base: dict, tmp: Path, engine: int, warmup: list[list[int]], batches: list[list[list[int]]]) -> dict:
    """An instance's steps: warm-up batch, "ready", then per repetition: wait for go, batch, "done"."""
    steps: list[dict] = [{"batch": [{"tokens": p} for p in warmup]}, {"touch": str(tmp / f"e{engine}-ready")}]
    for r, prompts in enumerate(batches):
        steps += [{"wait_for": str(tmp / f"e{engine}-go-{r}"), "timeout": STEP_TIMEOUT_S},
                  {"batch": [{"tokens": p} for p in prompts]}, {"touch": str(tmp / f"e{engine}-done-{r}")}]
    return {**base, "prompts": steps}


def run_bench_miss(settings: MissSettings = MissSettings(), json_out: Path | None = None,
                   plot: Path | None = None) -> dict:
    from kvring.engine.run import start_instance, write_tiny_llama

    s = settings
    console = Console(width=None if Console().is_terminal else 160)
    env = _thread_binding(s.omp_bind)
    instances = []
    started = time.perf_counter()
    # The model, the instances' logs and every file vLLM and torch write: removed however the run ends.
    with run_directory("bench-miss") as tmp:
        try:
            with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                          TimeElapsedColumn(), console=console) as bar:
                task = bar.add_task("writing a random Llama (no download)", total=3 + 2 * s.repetitions)
                model = str(write_tiny_llama(tmp / "model", layers=s.layers, hidden=s.hidden, heads=s.heads,
                                             kv_heads=s.kv_heads, vocab=s.vocab, head_dim=s.head_dim,
                                             intermediate=s.intermediate))
                bar.advance(task)
                bar.update(task, description="starting etcd and 3 cache nodes")
                with LocalCluster(nodes=3, memory=s.memory, cluster="bench-miss", tls=s.tls) as cluster:
                    bar.advance(task)
                    bar.update(task, description="starting both vLLM instances (and a warm-up batch each)")
                    warmup = _prompts(s, 0, s.warmup_prompts, seed=1)
                    batches = [_prompts(s, s.warmup_prompts + r * s.prompts, s.prompts, seed=100 + r)
                               for r in range(s.repetitions)]
                    base = {"model": model, "max_tokens": 1, "max_model_len": max(8192, s.tokens + 64)}
                    conn = cluster.connector()
                    (tmp / "vllm-tmp").mkdir()
                    for e, name in enumerate(ENGINES):
                        spec = _spec({**base, "connector": conn if name == "kvring" else None}, tmp, e, warmup, batches)
                        instances.append(start_instance(tmp, f"engine{e}", spec, tmpdir=tmp / "vllm-tmp", env=env))
                    for e, inst in enumerate(instances):
                        inst.wait_file(tmp / f"e{e}-ready", STEP_TIMEOUT_S)
                    bar.advance(task)
                    for r in range(s.repetitions):
                        order = (0, 1) if r % 2 == 0 else (1, 0)
                        for e in order:
                            bar.update(task, description=f"repetition {r + 1}/{s.repetitions}: {ENGINES[e]}")
                            time.sleep(SETTLE_S)
                            (tmp / f"e{e}-go-{r}").touch()
                            instances[e].wait_file(tmp / f"e{e}-done-{r}", STEP_TIMEOUT_S)
                            bar.advance(task)
                    outs = [inst.result(timeout=120) for inst in instances]
        finally:
            for inst in instances:
                inst.stop()

    results = _results(s, outs, time.perf_counter() - started, env.get("VLLM_CPU_OMP_THREADS_BIND"))
    console.print(_table(results))
    for note in results["notes"]:
        console.print(f"- {note}")
    write_outputs(console, results, json_out, plot, _plot)
    return results


def _results(s: MissSettings, outs: list[dict], elapsed: float, bind: str | None) -> dict:
    """Per repetition and engine: throughput and the connector's counters during the batch."""
    tokens = s.prompts * s.tokens
    reps = []
    for r in range(s.repetitions):
        rep = {"repetition": r + 1, "first": ENGINES[0] if r % 2 == 0 else ENGINES[1]}
        for e, name in enumerate(ENGINES):
            steps = outs[e]["steps"]
            step, before = steps[1 + r], steps[r]  # steps[0]: the warm-up batch
            delta = {k: step["counters"].get(k, 0.0) - before["counters"].get(k, 0.0) for k in COUNTERS} \
                if step["counters"] else None
            rep[name] = {"seconds": step["seconds"], "tokens_per_s": tokens / step["seconds"], "counters": delta}
        kv = rep["kvring"]
        kv["hook_share"] = kv["counters"]["scheduler_hook_seconds"] / kv["seconds"]
        rep["throughput_ratio"] = kv["tokens_per_s"] / rep["no connector"]["tokens_per_s"]
        reps.append(rep)

    summ = {name: {"tokens_per_s": summary([r[name]["tokens_per_s"] for r in reps]),
                   "seconds": summary([r[name]["seconds"] for r in reps])} for name in ENGINES}
    kv = summ["kvring"]
    kv["hook_seconds"] = summary([r["kvring"]["counters"]["scheduler_hook_seconds"] for r in reps])
    kv["hook_share"] = summary([r["kvring"]["hook_share"] for r in reps])
    for name in ("lookups", "lookups_past_deadline", "lookup_errors", "hit_tokens", "saved_bytes"):
        kv[name] = summary([r["kvring"]["counters"][name] for r in reps])
    summ["throughput_ratio"] = summary([r["throughput_ratio"] for r in reps])
    results = {"model": {"layers": s.layers, "hidden": s.hidden, "intermediate": s.intermediate, "heads": s.heads,
                         "kv_heads": s.kv_heads, "head_dim": s.head_dim, "vocab": s.vocab},
               "prompts": s.prompts, "tokens": s.tokens, "repetitions": s.repetitions,
               "omp_bind": s.omp_bind, "tls": s.tls, "omp_cpus": bind or os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
               "summary": summ, "runs": reps, "elapsed_s": elapsed}
    results["notes"] = _notes(results)
    return results


def _notes(results: dict) -> list[str]:
    summ = results["summary"]
    kv, ratio = summ["kvring"], summ["throughput_ratio"]
    notes = [f"Hook share: the seconds the connector's scheduler-side hooks held vLLM's scheduler loop "
             f"(vllm:kvring_scheduler_hook_seconds_total) over the batch's wall time; median "
             f"{kv['hook_share']['median']:.3%}."]
    if kv["hit_tokens"]["max"]:
        notes.append(f"UNEXPECTED: {kv['hit_tokens']['max']:.0f} tokens hit although every prompt was new.")
    if kv["lookups_past_deadline"]["max"]:
        notes.append("Lookups past their deadline: those requests waited lookup_deadline_ms and then recomputed.")
    if results["omp_cpus"]:
        notes.append(f"Both engines' OpenMP threads bound to CPUs {results['omp_cpus']} "
                     "(VLLM_CPU_OMP_THREADS_BIND), so both compute with the same threads.")
    else:
        notes.append("vLLM's own thread binding (--omp-bind vllm): it keeps one more core back for the "
                     "scheduler when a KV connector is configured, so the engines may compute with different "
                     "numbers of threads (on 2 cores: 1 without a connector, 2 with one) and the throughput "
                     "ratio then measures that, not kvring.")
    ratio_range = f"{ratio['min']:.3f}-{ratio['max']:.3f}"
    if ratio["min"] > 1:
        notes.append(f"kvring was faster in every repetition (ratio {ratio_range}): a connector cannot make a miss "
                     "cheaper, so this is the engines' difference (or noise), not kvring's gain; the hook share "
                     "measures the connector's scheduler-side cost directly.")
    elif ratio["max"] < 1:
        notes.append(f"kvring was slower in every repetition (ratio {ratio_range}).")
    else:
        notes.append(f"The throughput ratio's spread ({ratio_range}) includes 1: no difference measurable here.")
    return notes


def _table(results: dict) -> Table:
    m, summ = results["model"], results["summary"]
    table = Table(title=f"kvring bench miss: 0 % hits, {results['prompts']} prompts x {results['tokens']} tokens "
                        f"in one batch, {m['layers']}-layer hidden-{m['hidden']} Llama (MLP {m['intermediate']}) "
                        f"on CPU, 3 nodes ({'mutual TLS' if results['tls'] else 'plain TCP'}); median (min-max) of "
                        f"{results['repetitions']}")
    for col in ("engine", "prompt tokens/s", "batch", "vs no connector", "hook s", "hook share", "lookups",
                "past deadline", "saved"):
        table.add_column(col, justify="right", overflow="fold")
    plain, kv = summ["no connector"], summ["kvring"]
    table.add_row("no connector", spread(plain["tokens_per_s"], ",.0f"), spread(plain["seconds"], ".2f"),
                  "", "", "", "", "", "")
    saved = {k: v / 2**20 for k, v in kv["saved_bytes"].items()}
    table.add_row("kvring", spread(kv["tokens_per_s"], ",.0f"), spread(kv["seconds"], ".2f"),
                  spread(summ["throughput_ratio"], ".3f"), spread(kv["hook_seconds"], ".3f"),
                  spread({k: 100 * v for k, v in kv["hook_share"].items()}, ".2f") + " %",
                  spread(kv["lookups"], ".0f"), spread(kv["lookups_past_deadline"], ".0f"),
                  f"{saved['median']:,.0f} MiB")
    return table


def _plot(results: dict, path: Path) -> None:
    runs = results["runs"]
    share = results["summary"]["kvring"]["hook_share"]["median"]
    grouped_bars(path, [f"repetition {r['repetition']}" for r in runs],
                 {name: [r[name]["tokens_per_s"] for r in runs] for name in ENGINES},
                 "prompt tokens/s",
                 f"vLLM (CPU), 0 % hits: with kvring vs no connector (hook share {share:.2%})")

