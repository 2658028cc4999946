"""Comparing greedy outputs where vLLM recomputes from a block of its own choosing.

A load that goes through whole writes, bit for bit, the K/V the storing instance computed (as
``test_vllm_load_end`` proves on the bytes), so its output is compared with the recompute's
exactly.  A load that fails partway (a node stopped or lost in the middle of it) leaves vLLM to
recompute the prompt from the first failed block: its prefill then starts at a split the
reference's did not, and the bf16 attention sums run in another order.  The tiny random Llama's
logits are nearly flat (its top two tokens are a median 0.055 apart in logprob, 0.004 at the
least), so such a recompute may take the other token of a near tie.  vLLM does the same with no
connector at all: its own prefix cache, recomputing 12 prompts of 2,049 tokens from blocks 1,
4, 7, 8, 12 and 15, changed the 4th token of one prompt recomputed from block 15, where the
reference's two tokens were 2^-7 apart and the recompute's tied exactly.

``greedy_difference`` forgives exactly that: outputs equal up to the first token where they
differ, and there each run's choice and the other's within ``TIE`` of each other in that run's
own logprobs (a few bf16 steps of the logits).  What follows a near tie is no longer comparable.
Wrong K/V shows otherwise: a token the reference puts well below its own, or not in its top
logprobs at all.

Both runs must keep logprobs, run alike: vLLM's sampler asked for logprobs took the other side
of an exact tie than without them (the admission test's prompt 2: its 4th token 1758 with, 214
without), so a reference without logprobs is no reference for a run with them.
"""

from __future__ import annotations

TIE = 1 / 64


def greedy_difference(got: dict, ref: dict, tie: float = TIE) -> str | None:
    """``None`` when ``got``'s tokens are ``ref``'s, or first differ at a near tie in both runs'
    logprobs (``kvring.engine.run`` results, run with ``"logprobs"``); else what differs."""
    a, b = got["tokens"], ref["tokens"]
    if a == b:
        return None
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None:
        return f"{len(a)} tokens against {len(b)}: {a} != {b}"
    for name, run, mine, other in (("got", got, a[k], b[k]), ("reference", ref, b[k], a[k])):
        if not run.get("logprobs"):
            return f"token {k} differs ({a[k]} != {b[k]}) and the {name} run kept no logprobs to tell a near tie"
        step = run["logprobs"][k]
        if str(other) not in step:
            return f"token {k} differs ({a[k]} != {b[k]}): {other} is not among the {name} run's top logprobs"
        gap = step[str(mine)] - step[str(other)]
        if gap > tie:
            return (f"token {k} differs ({a[k]} != {b[k]}): the {name} run put {other} {gap:.4f} below {mine} "
                    f"in logprob, no near tie (> {tie:.4f})")
    return None
