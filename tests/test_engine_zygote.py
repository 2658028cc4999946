"""The engine zygote (``kvring/engine/zygote.py``): instances forked from it are what a spawned
instance is (a session, an environment, a log of its own, the same output), a stopped one leaves
no process, and a zygote that dies is replaced rather than taking the instances after it down."""

from __future__ import annotations

import os

import pytest

from kvring.engine import zygote as zygote_module
from kvring.engine.preload import engine_env
from kvring.engine.run import start_instance, write_tiny_llama
from kvring.engine.zygote import ForkedProcess, zygote
from polling import wait_for

PROMPT = list(range(10, 300))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


def _spec(model: str, **steps) -> dict:
    return {"model": model, "max_model_len": 1024, "connector": None, "in_process": True,
            "prompts": [*steps.get("before", []), {"tokens": PROMPT}]}


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_forked_instance_is_its_own_session_with_its_own_environment_and_the_spawned_output(
        model, tmp_path, monkeypatch):
    started, go = tmp_path / "started", tmp_path / "go"
    held = _spec(model, before=[{"touch": str(started)}, {"wait_for": str(go), "timeout": 120}])

    monkeypatch.setenv(zygote_module.ZYGOTE_ENV, "1")
    # An environment the zygote was not started with, which vLLM reads once the engine is built.
    forked = start_instance(tmp_path, "forked", held, env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    try:
        assert isinstance(forked.proc, ForkedProcess)
        forked.wait_file(started, timeout=120)
        pid = forked.proc.pid
        assert _parent(pid) == zygote(engine_env()).proc.pid  # forked, not spawned
        assert os.getsid(pid) == pid and os.getpgid(pid) == pid  # a session of its own
        assert forked.proc.poll() is None
        go.touch()
        out = forked.result(timeout=120)
    finally:
        forked.stop()
    log = forked.log.read_text()
    assert "non-default args" in log  # vLLM's log went to the instance's log
    assert "Explicitly set (2.0/" in log  # a KV cache of the instance's VLLM_CPU_KVCACHE_SPACE

    monkeypatch.setenv(zygote_module.ZYGOTE_ENV, "0")
    spawned = start_instance(tmp_path, "spawned", _spec(model))
    try:
        assert not isinstance(spawned.proc, ForkedProcess)
        assert spawned.result(timeout=180)["results"][0]["tokens"] == out["results"][0]["tokens"]
    finally:
        spawned.stop()


def test_a_stopped_instance_leaves_no_process_and_a_dead_zygote_is_replaced(model, tmp_path, monkeypatch):
    monkeypatch.setenv(zygote_module.ZYGOTE_ENV, "1")
    started = tmp_path / "started"
    hung = start_instance(tmp_path, "hung", _spec(model, before=[{"touch": str(started)},
                                                                 {"wait_for": str(tmp_path / "never")}]))
    hung.wait_file(started, timeout=120)
    pid = hung.proc.pid
    hung.stop()
    assert hung.proc.poll() is not None
    assert not os.path.exists(f"/proc/{pid}")  # stopped and reaped

    # The zygote killed under a running instance: the instance runs on (a session of its own),
    # its driver still sees it running, and stopping it still ends it.
    orphan = start_instance(tmp_path, "orphan", _spec(model, before=[{"touch": str(tmp_path / "orphan-started")},
                                                                     {"wait_for": str(tmp_path / "never")}]))
    orphan.wait_file(tmp_path / "orphan-started", timeout=120)
    first = zygote(engine_env())
    first.proc.kill()
    first.proc.wait()
    assert orphan.proc.poll() is None
    orphan.stop()
    assert orphan.proc.poll() is not None
    again = start_instance(tmp_path, "after", _spec(model))
    try:
        assert isinstance(again.proc, ForkedProcess) and zygote(engine_env()) is not first
        assert len(again.result(timeout=180)["results"][0]["tokens"]) == 8
    finally:
        again.stop()
    wait_for(lambda: not os.path.exists(f"/proc/{again.proc.pid}"), what="the instance reaped")
