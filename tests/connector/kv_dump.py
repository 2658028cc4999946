"""Run prompts through one in-process vLLM engine with KVRingConnector and keep the KV each
prompt left in the paged cache (a test helper, run as a child process).

``python -P tests/connector/kv_dump.py SPEC.json OUT_DIR``: SPEC is ``kvring.engine.run``'s
format (token prompts only); the engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so the scheduler's connector and the worker's cache are both reachable.  When a request finishes,
vLLM hands the connector its block ids before it frees them; the KV of every prompt position
(``[layers, tokens, kv heads, K|V channels]``) is copied out then, before any later request can
reuse the blocks.

Each position is read where vLLM's CPU attention kernel keeps it (``token_index``), not at row
``offset`` of the standardized ``[B, H, N, C]`` view: the kernel stores a block's K transposed
(``[head_size, block_size]``) and then its V (``[block_size, head_size]``), so a view row holds
parts of several tokens.

OUT_DIR gets ``kv-<i>.pt`` per prompt and ``out.json``: each prompt's greedy tokens, the tokens
vLLM did not compute (``cached``) and, per generated token, the top logprobs (``{token: logprob}``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def token_index(dtype, num_heads: int, block_size: int, head_size: int):
    """Where vLLM's CPU kernel keeps each token of a block: ``[block_size, 2 * head_size]`` flat
    offsets into one (block, head)'s ``block_size * 2 * head_size`` elements (K channels, then V),
    found by writing each offset through the kernel's own ``cpu_attn_reshape_and_cache``."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, head_size)
    codes = torch.arange(1, head_size + 1, dtype=dtype)  # exact in bf16 up to 256
    index = torch.empty(block_size, 2 * head_size, dtype=torch.long)
    for t in range(block_size):
        cache = torch.zeros(1, num_heads, block_size, 2 * head_size, dtype=dtype)
        k, v = cache.view(1, num_heads, 2 * block_size, head_size).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(codes.expand(1, num_heads, head_size).contiguous(),
                                       (-codes).expand(1, num_heads, head_size).contiguous(), k, v,
                                       torch.tensor([t]), isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        flat = cache[0, 0].flatten()
        for half, sign in ((0, 1), (1, -1)):
            where = [(flat == sign * (c + 1)).nonzero().flatten() for c in range(head_size)]
            assert all(len(w) == 1 for w in where), "one element per channel"
            index[t, half * head_size:(half + 1) * head_size] = torch.cat(where)
    return index


def main(spec_path: str, out_dir: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    import torch
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvring.engine.run import _prompt, engine_kwargs, top_logprobs

    out = Path(out_dir)
    llm = LLM(**engine_kwargs(spec))
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    caches = get_kv_transfer_group()._worker.kv_caches
    first = next(iter(caches.values()))
    _, heads, block_size, channels = first.shape
    index = token_index(first.dtype, heads, block_size, channels // 2)
    captured: dict[str, torch.Tensor] = {}
    finished = connector.request_finished

    def request_finished(request, block_ids):
        n = request.num_prompt_tokens
        blocks = torch.tensor(block_ids, dtype=torch.long)
        t = torch.arange(n)
        b, o = blocks[t // block_size], t % block_size
        # [layers, tokens, heads, 2 * head_size]: each token's K|V where the kernel keeps them
        where = index[o][:, None, :].expand(n, heads, channels)
        captured[request.request_id] = torch.stack([kv.flatten(2)[b].gather(2, where) for kv in caches.values()])
        return finished(request, block_ids)

    connector.request_finished = request_finished
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, detokenize=False,
                            logprobs=spec.get("logprobs", 5))
    results = []
    for i, item in enumerate(spec["prompts"]):
        captured.clear()
        [res] = llm.generate([_prompt(spec, item)], params, use_tqdm=False)
        [kv] = captured.values()
        torch.save(kv, out / f"kv-{i}.pt")
        completion = res.outputs[0]
        results.append({"tokens": list(completion.token_ids), "cached": res.num_cached_tokens,
                        "logprobs": top_logprobs(completion)})
    (out / "out.json").write_text(json.dumps({"results": results}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
