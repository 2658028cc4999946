"""Run prompts through one real vLLM engine (CPU build), optionally with KVRingConnector.

A child-process entry point (vLLM starts its engine in a spawned process, and each instance
must be a separate process): ``python -P -m kvring.vllm_run SPEC.json OUT.json``.  SPEC holds
the model dir, the prompts (token ids), and the connector settings (or none); OUT gets each
prompt's greedy output tokens, its time to first token and the tokens loaded from kvring.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path


def write_tiny_llama(path: Path, layers: int = 2, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
                     vocab: int = 2048, seed: int = 0, head_dim: int | None = None,
                     intermediate: int | None = None) -> Path:
    """A small random-weight Llama, saved locally (no download); MLP width ``2 * hidden`` unless given."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate or hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=16384, torch_dtype="bfloat16",
                         head_dim=head_dim or hidden // heads)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def run_instance(tmp: Path, name: str, spec: dict) -> dict:
    """Run ``spec`` in a vLLM instance of its own (a child process); its OUT as a dict."""
    import subprocess

    (tmp / f"{name}.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-P", "-m", "kvring.vllm_run", str(tmp / f"{name}.json"),
                           str(tmp / f"{name}.out")], capture_output=True, text=True)
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM instance {name!r} failed (exit {proc.returncode}; whole log in "
                           f"{tmp / name}.log):\n{proc.stderr[-4000:]}")
    return json.loads((tmp / f"{name}.out").read_text())


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if spec.get("connector"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVRingConnector", kv_connector_module_path="kvring.connector", kv_role="kv_both",
            kv_connector_extra_config=spec["connector"])
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True,
              dtype=spec.get("dtype", "bfloat16"),
              enable_prefix_caching=spec.get("prefix_caching", False), max_model_len=spec.get("max_model_len", 8192),
              max_num_batched_tokens=spec.get("max_model_len", 8192), gpu_memory_utilization=0.5, seed=0,
              disable_log_stats=False, **kw)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, detokenize=False)
    results = []
    for item in spec["prompts"]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=item["tokens"], cache_salt=item.get("salt"))]
                           if item.get("salt") else [TokensPrompt(prompt_token_ids=item["tokens"])],
                           params, use_tqdm=False)[0]
        t1 = time.perf_counter()
        metrics = getattr(out, "metrics", None)
        results.append({"tokens": list(out.outputs[0].token_ids), "seconds": t1 - t0,
                        "ttft": getattr(metrics, "first_token_latency", None) if metrics else None,
                        "cached": getattr(out, "num_cached_tokens", None)})
    keys, layout_fields = [], None
    if spec.get("connector"):
        from kvring.cachenode import ClusterClient
        from kvring.connector.connector import layout_from_vllm
        from kvring.connector.keys import request_keys

        with ClusterClient(spec["connector"]["etcd"], cluster=spec["connector"].get("cluster", "default")) as c:
            layout = layout_from_vllm(llm.llm_engine.vllm_config, c.contract.chunk_size)
        keys = [[k.hex() for k in request_keys(layout, item["tokens"], item.get("salt"))] for item in spec["prompts"]]
        layout_fields = dataclasses.asdict(layout)
    return {"results": results, "keys": keys, "layout": layout_fields}


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    Path(sys.argv[2]).write_text(json.dumps(run(spec)))
