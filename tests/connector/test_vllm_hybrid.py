"""A model with sliding-window layers next to full-attention ones, served by the real vLLM engine.

vLLM keeps its hybrid KV-cache manager on (the connector declares ``SupportsHMA``), which gives
the model one KV-cache group per attention kind; kvring does not load chunks into several block
tables yet, so the connector refuses the model at start, saying why and naming the flag that
makes it servable, instead of letting vLLM turn its hybrid manager off or serving it wrongly.
With that flag (``--disable-hybrid-kv-cache-manager``) every layer keeps its full KV in one
group, and an instance loads what another stored, its output equal to its own recompute.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvring.engine.run import run_instance
from kvring.local.cluster import LocalCluster


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=2048, max_position_embeddings=4096,
                         torch_dtype="bfloat16", sliding_window=256,
                         layer_types=["sliding_attention", "full_attention"])
    path = tmp_path_factory.mktemp("hybrid") / "sliding-llama"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["layer_types"][0] == "sliding_attention"
    return str(path)


def test_a_hybrid_model_is_refused_at_start_and_hma_stays_on(etcd_server, hybrid_model, tmp_path):
    with LocalCluster(nodes=1, memory=64 << 20, etcd=etcd_server.endpoint, cluster="e2e-hybrid") as cluster:
        spec = {"model": hybrid_model, "max_model_len": 2048,
                "connector": {"etcd": cluster.etcd, "cluster": cluster.cluster},
                "prompts": [{"tokens": list(range(10, 600))}]}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, "-P", "-m", "kvring.engine.run", str(tmp_path / "spec.json"),
                               str(tmp_path / "out.json")], capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, "the engine served a hybrid model through the connector"
    assert "KVRingConnector cannot serve this model without risking wrong KV" in log, log[-4000:]
    assert "2 KV-cache groups" in log and "SlidingWindowSpec" in log, log[-4000:]
    assert "--disable-hybrid-kv-cache-manager" in log, log[-4000:]
    # The refusal came from the connector with vLLM's hybrid KV manager on, not after turning it off.
    assert "Turning off hybrid kv cache manager" not in log
    assert not (tmp_path / "out.json").exists()


def test_with_the_hybrid_manager_off_it_loads_what_another_instance_stored(etcd_server, hybrid_model, tmp_path):
    prompt = list(range(10, 1110))  # 4 whole chunks, longer than the 256-token window
    with LocalCluster(nodes=2, memory=128 << 20, etcd=etcd_server.endpoint, cluster="e2e-hybrid-off") as cluster:
        conn = {"etcd": cluster.etcd, "cluster": cluster.cluster, "load_admission": False,
                "lookup_deadline_ms": 10_000}
        base = {"model": hybrid_model, "dtype": "float32", "max_model_len": 2048, "connector": conn,
                "disable_hybrid_kv_cache_manager": True}
        run_instance(tmp_path, "A", {**base, "prompts": [{"tokens": prompt}]})
        b = run_instance(tmp_path, "B", {**base, "prompts": [{"tokens": prompt, "salt": "b"}, {"tokens": prompt}]})
    ref, loaded = b["results"]
    assert ref["cached"] == 0 and loaded["cached"] == 1024 and loaded["tokens"] == ref["tokens"]
