"""The connector's scheduler side against real etcd and real node processes (no vLLM engine needed).

Lookups never hold the scheduler: an answer comes on a later call, a hung node (SIGSTOP) delays
only the requests whose chunks it owns and only up to the lookup deadline, a request is looked up
once however often vLLM asks, and a weights epoch moves every key.  Admission is tested on its
cost model.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from polling import wait_for

from kvring.cachenode.client import ClusterClient
from kvring.common.chunk import ChunkItem
from kvring.cachenode.client import Transfer
from kvring.connector.admission import PROBE_INTERVAL_S, SAMPLE_TTL_S, WINDOW, LoadCostModel, Refusal
from kvring.connector.config import ConnectorConfig
from kvring.connector.keys import KVLayout, request_keys
from kvring.connector.parts import STATE
from kvring.connector.scheduler import SchedulerSide

CHUNK = 256
LAYOUT = KVLayout(model="tiny", config_fingerprint="f", kv_dtype="bfloat16", num_layers=2, num_kv_heads=2,
                  head_size=16, block_layout="BHNC", chunk_size=CHUNK)
DEADLINE_MS = 400.0


def _request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
                           cache_salt=None, mm_features=None, lora_request=None, prompt_embeds=None)


def _store(client: ClusterClient, keys: list[bytes], parts: list[int] | None = None) -> None:
    """Store every part of the chunks ``keys`` (one per KV head), or only the heads ``parts``."""
    data = np.zeros(2 * CHUNK * 1 * 32 * 2, dtype=np.uint8)  # bfloat16: 2 bytes each
    chosen = [p for p in LAYOUT.parts().parts if parts is None or p.head in parts]
    assert all(client.put_many([ChunkItem.of(p.key(k), data, [2, CHUNK, 1, 32], "bfloat16", CHUNK)
                                for k in keys for p in chosen]))


def _poll(sched: SchedulerSide, request, timeout: float = 5.0) -> tuple[int, float, float]:
    """Ask as vLLM does, once per 'step', until answered: (tokens, seconds to the answer, longest call)."""
    start, longest = time.monotonic(), 0.0
    while time.monotonic() - start < timeout:
        t0 = time.monotonic()
        n, is_async = sched.get_num_new_matched_tokens(request, 0)
        longest = max(longest, time.monotonic() - t0)
        if n is not None:
            assert not is_async
            return n, time.monotonic() - start, longest
        sched.new_step()
        time.sleep(0.005)
    raise AssertionError(f"no answer within {timeout} s")


@pytest.fixture
def cluster(cluster_factory):
    return cluster_factory(nodes=3)


def _scheduler(cluster, **settings) -> tuple[SchedulerSide, ClusterClient]:
    config = ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster, lookup_deadline_ms=DEADLINE_MS, **settings)
    client = ClusterClient(cluster.etcd, cluster=cluster.cluster)
    assert client.wait_for_nodes(3)
    return SchedulerSide(config, LAYOUT, client, block_size=16, bytes_per_token=256), client


def _prompt_owned(client: ClusterClient, rng, chunks: int, want_node: str | None, avoid_node: str | None):
    """Random tokens whose chunks' parts are owned (the first chunk's first) by ``want_node`` /
    never by ``avoid_node``."""
    for _ in range(500):
        tokens = rng.integers(10, 30_000, size=chunks * CHUNK + 7).tolist()
        owners = [client.owners(k)[0] for k in LAYOUT.parts().keys(request_keys(LAYOUT, tokens))]
        if want_node is not None and owners[0] != want_node:
            continue
        if avoid_node is not None and avoid_node in owners:
            continue
        return tokens
    raise AssertionError("no such prompt found")


def test_a_lookup_answers_on_a_later_call_and_is_sent_once(cluster):
    sched, client = _scheduler(cluster, lookup_wait_ms=0)
    try:
        tokens = np.random.default_rng(0).integers(10, 30_000, size=3 * CHUNK + 5).tolist()
        keys = request_keys(LAYOUT, tokens)
        _store(client, keys[:2])
        _store(client, keys[2:3], parts=[0])  # chunk 2: one rank's save landed, the other's did not
        request = _request("r", tokens)
        # The first lookup's answer is held back until the first call has been made, so that call
        # cannot have it (on a busy machine the real answer could otherwise beat it).
        release = threading.Event()
        real = client.lookup_async
        holder = concurrent.futures.ThreadPoolExecutor(1)

        def held(keys, lease_ms=0, meter=None):
            return holder.submit(lambda: (release.wait(10), client.lookup(keys, lease_ms, meter))[1])

        sched.client.lookup_async = held
        sched.on_new_request(request)
        # With no waiting allowed, the first call cannot have the answer yet.
        assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
        sched.client.lookup_async = real
        release.set()
        holder.shutdown(wait=False)
        n, _, _ = _poll(sched, request)
        assert n == 2 * CHUNK
        for _ in range(50):  # vLLM asks again while the request waits for blocks: no new lookup
            assert sched.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, False)
        # Tokens vLLM already holds are not counted again; nothing beyond the hit is loaded.
        assert sched.get_num_new_matched_tokens(request, 256) == (256, False)
        assert sched.get_num_new_matched_tokens(request, 512) == (0, False)
        stats = sched.counters.take()
        assert stats.data["lookups"] == 1 and stats.data["lookups_past_deadline"] == 0
        # A request that arrives without on_new_request (back after a preemption) is looked up then.
        again = _request("r2", tokens)
        n2, _, _ = _poll(sched, again)
        assert n2 == 2 * CHUNK
    finally:
        sched.shutdown()
        client.close()


def test_a_hung_node_delays_only_its_requests_and_only_until_the_deadline(cluster):
    sched, client = _scheduler(cluster)
    rng = np.random.default_rng(1)
    victim = cluster.nodes[0]
    try:
        hung_tokens = _prompt_owned(client, rng, 2, want_node=victim.node_id, avoid_node=None)
        free_tokens = _prompt_owned(client, rng, 3, want_node=None, avoid_node=victim.node_id)
        _store(client, request_keys(LAYOUT, hung_tokens) + request_keys(LAYOUT, free_tokens))
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            hung, free = _request("hung", hung_tokens), _request("free", free_tokens)
            start = time.monotonic()
            sched.on_new_request(hung)
            sched.on_new_request(free)
            answers, longest = {}, 0.0
            while len(answers) < 2 and time.monotonic() - start < 5:  # one pass per scheduler step
                sched.new_step()
                for request in (hung, free):
                    if request.request_id in answers:
                        continue
                    t0 = time.monotonic()
                    n, _ = sched.get_num_new_matched_tokens(request, 0)
                    longest = max(longest, time.monotonic() - t0)
                    if n is not None:
                        answers[request.request_id] = (n, time.monotonic() - start)
                time.sleep(0.005)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        (n_free, t_free), (n_hung, t_hung) = answers["free"], answers["hung"]
        assert n_free == 3 * CHUNK  # every chunk found: the hung node owns none of them
        assert t_free < 0.25  # generous: a healthy lookup is a few milliseconds
        # The hung node's request is a miss, decided at the deadline (not at the 5 s node timeout).
        assert n_hung == 0 and DEADLINE_MS / 1000 <= t_hung < DEADLINE_MS / 1000 + 0.5
        # No single call held the scheduler longer than its per-step wait allowance (+ slack).
        assert longest < sched.config.lookup_wait_ms / 1000 + 0.05
        stats = sched.counters.take()
        assert stats.data["lookups_past_deadline"] == 1 and stats.data["lookups"] == 2
    finally:
        sched.shutdown()
        client.close()


@pytest.mark.parametrize("after_ms", [300, 0])
def test_a_chunk_one_rank_saved_is_withdrawn_after_the_lookup_that_finds_it(cluster, after_ms):
    """Chunk 2 of a prompt has only rank 0's part (its anchor, which names its blocks to the pool's
    KV events): the other rank's save failed.  The lookup counts chunks 0-1, reports chunk 2
    broken, and ``withdraw_broken_after_ms`` later its anchor is deleted (no owner holds the
    missing part), so the pool stops crediting it.  The whole chunks keep theirs.  With 0 the
    connector withdraws nothing."""
    sched, client = _scheduler(cluster, withdraw_broken_after_ms=after_ms)
    try:
        tokens = np.random.default_rng(5).integers(10, 30_000, size=3 * CHUNK + 5).tolist()
        keys = request_keys(LAYOUT, tokens)
        anchor = LAYOUT.parts().anchor
        _store(client, keys[:2])
        _store(client, keys[2:3], parts=[anchor.head])
        assert _poll(sched, _request("r", tokens))[0] == 2 * CHUNK
        if after_ms:
            wait_for(lambda: client.lookup([anchor.key(keys[2])]) == [False], 10, "chunk 2's anchor deleted")
        else:
            time.sleep(1.0)
        assert client.lookup([anchor.key(k) for k in keys]) == [True, True, not after_ms]
        assert all(client.lookup(LAYOUT.parts().keys(keys[:2])))
        data = sched.counters.take().data
        assert (data["broken_chunks"], data["broken_chunks_withdrawn"]) == ((1, 1) if after_ms else (0, 0))
    finally:
        sched.shutdown()
        client.close()


def test_reset_cache_moves_every_key_to_a_new_weights_epoch(cluster):
    sched, client = _scheduler(cluster)
    try:
        tokens = np.random.default_rng(2).integers(10, 30_000, size=2 * CHUNK + 1).tolist()
        _store(client, request_keys(LAYOUT, tokens))
        assert _poll(sched, _request("before", tokens))[0] == 2 * CHUNK
        assert sched.reset_cache() is True
        after = _request("after", tokens)
        assert _poll(sched, after)[0] == 0  # chunks of the old weights are never loaded again
        assert set(sched._lookups["after"].keys).isdisjoint(request_keys(LAYOUT, tokens))
        assert sched._lookups["after"].inputs.scope.weights_epoch == 1
    finally:
        sched.shutdown()
        client.close()


def test_a_lookup_that_cannot_be_routed_is_a_miss_not_an_error(cluster_factory):
    cluster = cluster_factory(nodes=1)
    config = ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster, lookup_deadline_ms=DEADLINE_MS)
    client = ClusterClient(cluster.etcd, cluster=cluster.cluster)
    sched = SchedulerSide(config, LAYOUT, client, block_size=16, bytes_per_token=256)
    try:
        assert client.wait_for_nodes(1)
        cluster.nodes[0].stop()
        assert client.wait_for_nodes(0, timeout=20, exact=True)
        assert _poll(sched, _request("r", list(range(600))))[0] == 0
        assert sched.counters.take().data["lookup_errors"] == 1
    finally:
        sched.shutdown()
        client.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _transfer(node: str, nbytes: int, seconds: float, latency: float = 0.001, ok: bool = True) -> Transfer:
    return Transfer(node, nbytes, seconds, latency, 0, ok)


def _model(prefill_rate: float | None = 5000.0, **kw) -> tuple[LoadCostModel, _Clock]:
    clock = _Clock()
    model = LoadCostModel(bytes_per_token=1024, timeout_s=5.0, clock=clock, **kw)
    if prefill_rate is not None:
        model.prefill.append(prefill_rate)
    return model, clock


@pytest.mark.parametrize("rate, latency, prefill, admit", [
    (None, None, 5000.0, True),  # no load measured yet: admitted
    (1e9, 0.001, None, True),  # no prefill measured yet: admitted
    (1e9, 0.001, 5000.0, True),  # 4 MiB at 1 GB/s (5 ms) vs 0.8 s of prefill
    (1e6, 0.001, 5000.0, False),  # a crawling network: 4 s to load vs 0.8 s to recompute
    (1e9, 2.0, 5000.0, False),  # a node that takes 2 s to answer anything
])
def test_admission_loads_only_what_is_faster_than_recomputing(rate, latency, prefill, admit):
    model, _ = _model(prefill)
    if rate is not None:
        seconds = latency + (4 << 20) / rate
        model.loaded([_transfer("a", 4 << 20, seconds, latency)])
    decision = model.decide(4096, {"a": 1.0})
    assert decision.admit is admit and not decision.probe
    assert decision.refusal == (None if admit else Refusal.SLOWER)


def test_admission_splits_a_load_over_the_nodes_that_hold_it():
    model, _ = _model(prefill_rate=10_000.0)  # 0.4 s to recompute 4096 tokens
    for _ in range(3):
        model.loaded([_transfer("fast", 4 << 20, 0.005), _transfer("slow", 4 << 20, 4.0)])
    load_s, recompute_s = model.predict(4096, {"fast": 1.0})
    assert load_s == pytest.approx(0.001 + (4 << 20) / ((4 << 20) / 0.004)) and recompute_s == pytest.approx(0.4096)
    assert model.decide(4096, {"fast": 1.0}).admit  # its chunks are all on the fast node
    slow = model.decide(4096, {"fast": 0.5, "slow": 0.5})  # half on the slow one: 2 s for its half
    assert not slow.admit and slow.refusal == Refusal.SLOWER and slow.load_s == pytest.approx(2.0, rel=0.01)
    # A node not measured yet counts at the median of the others (here: between the two).
    assert model.predict(4096, {"fast": 1.0})[0] < model.predict(4096, {"new": 1.0})[0] < \
        model.predict(4096, {"slow": 1.0})[0]


def test_admission_measures_prefill_speed_robustly():
    model, _ = _model(prefill_rate=None)
    model.step_started(2048, loads=False, now=10.0)
    model.step_started(1, loads=True, now=10.5)  # the 2048-token step took 0.5 s
    assert model.prefill_rate == pytest.approx(4096)
    model.step_started(8, loads=False, now=12.0)  # a step with a load is not a prefill sample
    assert model.prefill_rate == pytest.approx(4096)
    for now in (13.0, 13.5, 14.0):
        model.step_started(2048, loads=False, now=now)
    model.step_started(2048, loads=False, now=34.0)  # one step held up 20 s (a stall, a pause)
    assert model.prefill_rate == pytest.approx(4096)  # the median: one outlier moves nothing
    # An async load may take up to twice the recompute it saves (within [0.2 s, timeout]).
    assert model.deadline_s(4096) == pytest.approx(2.0)
    assert model.deadline_s(10) == pytest.approx(0.2)
    # A layerwise or bulk load holds its step: at least 1 s before it is abandoned.
    assert model.deadline_s(4096, asynchronous=False) == pytest.approx(2.0)
    assert model.deadline_s(10, asynchronous=False) == pytest.approx(1.0)
    assert LoadCostModel(1024, timeout_s=5.0, load_deadline_s=0.7).deadline_s(4096) == 0.7
    assert LoadCostModel(1024, timeout_s=5.0, load_deadline_s=0.7).deadline_s(4096, asynchronous=False) == 0.7


def test_a_stalled_load_marks_its_node_failing_and_its_recovery_is_trusted_within_seconds():
    """The scenario that turned loads off: one stalled load taken as a bandwidth sample."""
    model, clock = _model(prefill_rate=20_000.0)  # 0.2 s to recompute 4096 tokens
    for _ in range(5):
        model.loaded([_transfer("a", 2 << 20, 0.004), _transfer("b", 2 << 20, 0.004)])
    healthy = model.decide(4096, {"a": 0.5, "b": 0.5})
    assert healthy.admit and healthy.load_s < 0.01
    # "b" is stopped mid-load: it moved 64 KiB in 5 s (the client's timeout), then failed.
    model.loaded([_transfer("a", 2 << 20, 0.004), _transfer("b", 64 << 10, 5.0, ok=False)])
    assert model.predict(4096, {"a": 0.5, "b": 0.5})[0] == pytest.approx(healthy.load_s)  # not a sample
    stalled = model.decide(4096, {"a": 0.5, "b": 0.5})
    assert not stalled.admit and stalled.refusal == Refusal.NODE_FAILING
    assert model.decide(4096, {"a": 1.0}).admit  # loads that do not need "b" go on
    clock.now += 10
    assert not model.decide(4096, {"a": 0.5, "b": 0.5}).admit  # "b" has not answered anything since
    model.looked_up([Transfer("b", 0, 2.0, 2.0, 0, False)])  # a lookup it did not answer either
    clock.now += 1
    model.looked_up([Transfer("b", 0, 0.001, 0.001, 16, True)])  # resumed: it answers a lookup
    probe = model.decide(4096, {"a": 0.5, "b": 0.5})
    assert probe.admit and probe.probe and probe.refusal == Refusal.NODE_FAILING
    assert not model.decide(4096, {"a": 0.5, "b": 0.5}).admit  # one probe at a time
    model.loaded([_transfer("a", 2 << 20, 0.004), _transfer("b", 2 << 20, 0.004)])  # the probe loaded
    after = model.decide(4096, {"a": 0.5, "b": 0.5})
    assert after.admit and not after.probe


def test_a_node_that_keeps_failing_costs_one_probe_per_interval():
    model, clock = _model(prefill_rate=20_000.0)
    model.loaded([_transfer("a", 2 << 20, 0.004)])
    probes = 0
    for _ in range(40):  # 20 s of requests, two a second; "a" answers lookups but fails every load
        clock.now += 0.5
        model.looked_up([Transfer("a", 0, 0.001, 0.001, 16, True)])
        decision = model.decide(4096, {"a": 1.0})
        if decision.admit:
            probes += 1
            model.loaded([_transfer("a", 0, 2.0, ok=False)])
        else:
            assert decision.refusal == Refusal.NODE_FAILING
    assert probes == pytest.approx(20 / PROBE_INTERVAL_S, abs=2)  # the first at once, then one per interval


def test_a_slow_node_takes_a_majority_of_slow_loads_to_refuse_and_fast_ones_to_trust_again():
    model, clock = _model(prefill_rate=20_000.0)
    for _ in range(WINDOW):
        model.loaded([_transfer("a", 4 << 20, 0.004)])
    decisions = []
    for _ in range(WINDOW):  # it slows down for good: 4 MiB in 1 s, every load
        model.loaded([_transfer("a", 4 << 20, 1.0)])
        decisions.append(model.decide(4096, {"a": 1.0}).admit)
    assert decisions[:WINDOW // 2 - 1] == [True] * (WINDOW // 2 - 1) and not decisions[-1]
    refused = model.decide(4096, {"a": 1.0})
    assert refused.refusal == Refusal.SLOWER
    clock.now += SAMPLE_TTL_S + 1  # what it measured long ago no longer counts
    assert model.decide(4096, {"a": 1.0}).admit


def test_admission_decides_once_per_request_however_often_vllm_asks(cluster):
    sched, client = _scheduler(cluster)
    try:
        tokens = np.random.default_rng(4).integers(10, 30_000, size=3 * CHUNK + 1).tolist()
        _store(client, request_keys(LAYOUT, tokens))
        sched.cost.prefill.append(1e9)  # recomputing predicted instant, loading hopeless
        for node_id in client.members:
            sched.cost.loaded([Transfer(node_id, 1 << 20, 100.0, 0.0, 0, True)])
        request = _request("r", tokens)
        assert _poll(sched, request)[0] == 0
        for _ in range(20):  # a request waiting for blocks is asked again and again
            assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        stats = sched.counters.take().data
        assert stats["loads_refused"] == {"slower": 1} and stats["lookups"] == 1
    finally:
        sched.shutdown()
        client.close()


def test_a_request_whose_adapter_cannot_be_read_recomputes(cluster):
    sched, client = _scheduler(cluster)
    try:
        request = _request("r", list(range(10, 3 * CHUNK)))
        request.lora_request = SimpleNamespace(lora_name="gone", lora_int_id=1, lora_path="/nonexistent/adapter")
        sched.on_new_request(request)  # the keys cannot be made: no lookup, no error into vLLM
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        stats = sched.counters.take()
        assert stats is None or stats.data["lookups"] == 0
    finally:
        sched.shutdown()
        client.close()


def test_a_step_that_computes_nothing_is_marked_idle_for_the_workers(cluster):
    """The metadata says when vLLM computes no token this step (its requests wait, e.g. for async
    loads): the workers' get_finished may then block until a load ends instead of vLLM's loop
    running empty steps back to back."""
    sched, client = _scheduler(cluster)
    try:
        def step(tokens: int) -> SimpleNamespace:  # a SchedulerOutput with no new or running requests
            return SimpleNamespace(total_num_scheduled_tokens=tokens, scheduled_new_reqs=[], num_scheduled_tokens={},
                                   scheduled_cached_reqs=SimpleNamespace(req_ids=[]))

        assert sched.build_connector_meta(step(0)).idle
        assert not sched.build_connector_meta(step(37)).idle
    finally:
        sched.shutdown()
        client.close()


RECURRENT = KVLayout(model="tiny-ssm", config_fingerprint="f", kv_dtype="bfloat16", num_layers=2, num_kv_heads=2,
                     head_size=16, block_layout="BHNC", chunk_size=CHUNK, windows=(STATE, 0),
                     state_format="gdn|(3, 8):bfloat16|conv=SD")


def test_a_model_with_state_hits_up_to_its_last_saved_state_and_saves_the_states_vllm_hands_over(cluster):
    """A model with recurrent state (its group 0): a hit ends on the last chunk whose state is
    stored, with every attention part before it; of the states vLLM offers in a step, those that
    end a chunk of the prompt past the hit are saved, from the block vLLM named -- not a state
    inside a chunk, not another group's block, not a preempted request's."""
    config = ConnectorConfig(etcd=cluster.etcd, cluster=cluster.cluster, lookup_deadline_ms=DEADLINE_MS,
                             load_mode="async", load_admission=False)
    client = ClusterClient(cluster.etcd, cluster=cluster.cluster)
    assert client.wait_for_nodes(3)
    sched = SchedulerSide(config, RECURRENT, client, block_size=16, bytes_per_token=256, state_group=0)
    try:
        rng = np.random.default_rng(21)
        tokens = rng.integers(10, 30_000, size=4 * CHUNK + 7).tolist()
        request = _request("ssm", tokens)
        request.all_token_ids = tokens
        keys = request_keys(RECURRENT, tokens)
        attention, state = [p for p in RECURRENT.parts().parts if not p.state], RECURRENT.parts().parts[0]
        kv = np.zeros(CHUNK * 32 * 2, dtype=np.uint8)
        assert all(client.put_many([ChunkItem.of(p.key(k), kv, [1, CHUNK, 1, 32], "bfloat16", CHUNK)
                                    for k in keys for p in attention]))
        # States after chunks 0 and 1, none after 2 or 3.
        assert all(client.put_many([ChunkItem.of(state.key(k), np.ones(64, dtype=np.uint8), [1, 1, 1, 64], "uint8", 1)
                                    for k in keys[:2]]))
        sched.on_new_request(request)
        n, is_async = None, None
        deadline = time.monotonic() + 5
        while n is None and time.monotonic() < deadline:
            n, is_async = sched.get_num_new_matched_tokens(request, 0)
            sched.new_step()
        assert (n, is_async) == (2 * CHUNK, True)
        blocks = SimpleNamespace(get_block_ids=lambda: ([0] * 31 + [77], list(range(100, 165))))
        sched.update_state_after_alloc(request, blocks, 2 * CHUNK)
        block_state = SimpleNamespace(boundary_state_offloads={
            # 512 (loaded), 600 (inside a chunk), 768 of group 1 (not the state), 768 and 1024 (saved)
            "ssm": [(0, 5, 2 * CHUNK), (0, 6, 600), (1, 9, 3 * CHUNK), (0, 7, 3 * CHUNK), (0, 8, 4 * CHUNK)],
            "gone": [(0, 11, CHUNK)]})  # preempted as this step was scheduled
        new = SimpleNamespace(req_id="ssm", prompt_token_ids=tokens, block_ids=([0] * 31 + [77], list(range(100, 165))),
                              num_computed_tokens=2 * CHUNK)
        out = SimpleNamespace(total_num_scheduled_tokens=len(tokens) - 2 * CHUNK, scheduled_new_reqs=[new],
                              num_scheduled_tokens={"ssm": len(tokens) - 2 * CHUNK},
                              scheduled_cached_reqs=SimpleNamespace(req_ids=[]), kv_connector_block_state=block_state,
                              preempted_req_ids={"gone"})
        meta = sched.build_connector_meta(out)
        assert [(s.key, s.block) for s in meta.states] == [(keys[2], 7), (keys[3], 8)]
        loads = [r.load for r in meta.requests if r.load is not None]
        assert [(load.end, load.state_block) for load in loads] == [(2 * CHUNK, 77)]
    finally:
        sched.shutdown()
        client.close()
