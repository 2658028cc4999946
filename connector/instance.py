"""What the connector takes from one vLLM instance's configuration.

Its key layout (``KVLayout``: model, config and revision fingerprint, KV dtype and shape), the
parts a chunk is stored as and the heads and layers one worker of it holds (``parts.py``), and
whether its KV cache and parallel layout are ones the connector can serve without risking
wrong KV.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass

from .admission import LoadBytes
from .keys import KVLayout
from .parts import STATE, ChunkParts, RankShard


@dataclass(frozen=True)
class KVGroups:
    """vLLM's KV-cache groups as the connector loads and saves them.

    With one group every layer shares one block table.  With vLLM's hybrid KV-cache manager a
    model with sliding-window layers has a block table per group, and a sliding-window group
    keeps blocks only for its window's tokens (the rest of its table is vLLM's null block).
    """

    layer_groups: dict[str, int]  # attention layer name -> index of its group (its block table)
    # each model layer's kind: its sliding window, 0 (full attention) or ``STATE``; () when all are full
    windows: tuple[int, ...] = ()
    state: StateGroup | None = None  # the recurrent-state layers' group, if the model has one

    @classmethod
    def of(cls, kv_cache_config, num_layers: int) -> KVGroups:
        """The groups of ``kv_cache_config`` (``None``: one group, e.g. a unit test's caches)."""
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        layer_groups = {name: g for g, group in enumerate(groups) for name in group.layer_names
                        if not isinstance(group.kv_cache_spec, MambaSpec)}
        if not any(isinstance(group.kv_cache_spec, (SlidingWindowSpec, MambaSpec)) for group in groups):
            return cls(layer_groups)
        windows = [0] * num_layers
        state = None
        for g, group in enumerate(groups):
            spec = group.kv_cache_spec
            if type(spec) is SlidingWindowSpec or isinstance(spec, MambaSpec):
                for name in group.layer_names:
                    windows[extract_layer_index(name)] = STATE if isinstance(spec, MambaSpec) else spec.sliding_window
            if isinstance(spec, MambaSpec):
                state = StateGroup.of(g, group)
        return cls(layer_groups, tuple(windows), state)

    @property
    def several(self) -> bool:
        """Whether there are several block tables (vLLM then takes failed loads per request only)."""
        return len(set(self.layer_groups.values()) | ({self.state.group} if self.state else set())) > 1

    @property
    def hybrid(self) -> bool:
        """Whether some group is a sliding window (each group is then loaded as it needs)."""
        return bool(self.windows)

    def group_of(self, layer_name: str) -> int:
        return self.layer_groups.get(layer_name, 0)


@dataclass(frozen=True)
class StateGroup:
    """The KV-cache group of a model's recurrent-state layers (vLLM's ``MambaSpec``): in align
    mode each of its blocks holds, per layer, the state after the block's last token, as the
    first ``nbytes`` bytes of the layer's page of that block (the tensors of ``shapes`` and
    ``dtypes`` one after another; vLLM pads the page to the attention page's size)."""

    group: int
    layer_names: tuple[str, ...]  # in model-layer order
    nbytes: int
    format: str  # what the bytes depend on (``KVLayout.state_format`` adds the shards)
    replicated: bool = False  # every tensor-parallel rank holds the whole state (else a slice)

    def shards(self, tp_size: int) -> int:
        """The slices a chunk's state is stored in: one per tensor-parallel rank, or one."""
        return 1 if self.replicated else tp_size

    @classmethod
    def of(cls, index: int, group) -> StateGroup:
        from vllm.model_executor.models.utils import extract_layer_index

        spec = group.kv_cache_spec
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(spec.shapes, spec.dtypes)]
        tensors = ";".join(f"{tuple(shape)}:{str(dtype).removeprefix('torch.')}"
                           for shape, dtype in zip(spec.shapes, spec.dtypes))
        conv_layout = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "")
        return cls(index, tuple(sorted(group.layer_names, key=extract_layer_index)), sum(sizes),
                   f"{type(spec.mamba_type).__name__}.{getattr(spec.mamba_type, 'name', spec.mamba_type)}"
                   f"|{tensors}|conv={conv_layout}", bool(getattr(spec, "tp_replicated", False)))


def layout_from_vllm(vllm_config, chunk_size: int, weights_version: str = "",
                     groups: KVGroups | None = None) -> KVLayout:
    """The KV-compatibility namespace of this vLLM instance (the same for every TP size; a
    hybrid layout's, with each layer's window, when ``groups`` has sliding windows)."""
    model = vllm_config.model_config
    hf = getattr(model, "hf_config", None)
    identity = (hf.to_json_string() if hf is not None else model.model) + f"\nrevision={model.revision}"
    fingerprint = hashlib.blake2b(identity.encode(), digest_size=16).hexdigest()
    kv_dtype = vllm_config.cache_config.cache_dtype
    if kv_dtype == "auto":
        kv_dtype = str(model.dtype).removeprefix("torch.")
    return KVLayout(
        model=str(model.model), config_fingerprint=fingerprint, kv_dtype=str(kv_dtype),
        num_layers=model.get_total_num_hidden_layers(), num_kv_heads=_total_kv_heads(model),
        head_size=model.get_head_size(), block_layout="BHNC", chunk_size=chunk_size,
        weights_version=weights_version, latent=bool(model.use_mla), windows=groups.windows if groups else (),
        state_format=state_format_of(vllm_config, groups))


def state_format_of(vllm_config, groups: KVGroups | None) -> str:
    """``KVLayout.state_format``: the state's bytes, and the slices it is stored in."""
    if groups is None or groups.state is None:
        return ""
    return f"{groups.state.format}|shards={groups.state.shards(vllm_config.parallel_config.tensor_parallel_size)}"


def _total_kv_heads(model) -> int:
    """The model's KV heads as its workers' caches hold them (an MLA latent is one, on every rank)."""
    return 1 if model.use_mla else model.get_total_num_kv_heads()


def stage_layers(num_layers: int, pp_size: int) -> tuple[tuple[int, int], ...]:
    """The layer range of each pipeline stage, as vLLM splits them (``get_pp_indices``, which
    honours ``VLLM_PP_LAYER_PARTITION``)."""
    from vllm.distributed.utils import get_pp_indices

    return tuple(get_pp_indices(num_layers, rank, pp_size) for rank in range(pp_size))


def chunk_parts(vllm_config, layout: KVLayout, groups: KVGroups | None = None) -> ChunkParts:
    """Every part of a chunk this instance loads: each KV head of each of its pipeline stages
    (and each slice of a recurrent state, ``groups`` having one)."""
    parallel = vllm_config.parallel_config
    shards = groups.state.shards(parallel.tensor_parallel_size) if groups and groups.state else 1
    return layout.parts(stage_layers(layout.num_layers, parallel.pipeline_parallel_size), shards)


def rank_shard(vllm_config) -> RankShard:
    """The heads and layers this worker process holds (call it in a worker, after vLLM set up
    its tensor- and pipeline-parallel groups)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    stages = stage_layers(model.get_total_num_hidden_layers(), parallel.pipeline_parallel_size)
    return RankShard.of_rank(_total_kv_heads(model), parallel.tensor_parallel_size,
                             get_tensor_model_parallel_rank(), stages[get_pp_group().rank_in_group])


def check_kv_groups(kv_cache_config) -> None:
    """Refuse a model whose KV the connector cannot load correctly (``ValueError`` saying why,
    naming the groups and what makes the model servable).

    kvring stores every layer of a token range as a chunk and loads it into each layer's block
    table: full attention (K and V per KV head), MLA (one latent per token, which vLLM hands over
    in the same ``[blocks, 1, block size, latent]`` view) in one group, and with vLLM's hybrid
    KV-cache manager, groups of full-attention and sliding-window layers (a window group keeps
    only its window's blocks, and is loaded and saved as such: ``KVGroups``).  State that is not
    attention KV (Mamba, linear attention) is saved and loaded as one state per chunk end
    (``StateGroup``) in vLLM's ``align`` mode only (other modes keep no state at block
    boundaries), and other kinds (chunked-local attention, sliding-window MLA) are not loaded
    yet.  Serving such a model through the connector would risk wrong KV, so it is refused at
    start rather than run wrongly.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])

    def named(i: int, g) -> str:
        more = f", ... ({len(g.layer_names)} layers)" if len(g.layer_names) > 2 else ""
        return f"group {i} ({type(g.kv_cache_spec).__name__}: {', '.join(g.layer_names[:2])}{more})"

    mamba = [(i, g) for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
    unaligned = [named(i, g) for i, g in mamba if g.kv_cache_spec.mamba_cache_mode != "align"]
    if unaligned:
        raise ValueError(f"KVRingConnector cannot serve this model without risking wrong KV: {'; '.join(unaligned)} "
                         "keep(s) recurrent state that vLLM hands to connectors only at block boundaries, in its "
                         "'align' mode. Start vLLM with --mamba-cache-mode align (and prefix caching on).")
    if len(mamba) > 1:
        raise ValueError("KVRingConnector cannot serve this model without risking wrong KV: it has several "
                         f"recurrent-state groups ({'; '.join(named(i, g) for i, g in mamba)}), and kvring stores one. "
                         "Serve it without --kv-transfer-config.")
    state = [named(i, g) for i, g in enumerate(groups)
             if not isinstance(g.kv_cache_spec, (AttentionSpec, MambaSpec))]
    if state:
        problem = (f"{'; '.join(state)} hold(s) state that is neither attention KV nor Mamba-style recurrent "
                   "state, which kvring does not know how to save or load")
        raise ValueError(f"KVRingConnector cannot serve this model without risking wrong KV: {problem}. "
                         "Serve it without --kv-transfer-config.")
    if len(groups) == 1 and _loadable(groups[0].kv_cache_spec):
        return
    odd = [named(i, g) for i, g in enumerate(groups)
           if type(g.kv_cache_spec) not in (FullAttentionSpec, SlidingWindowSpec)
           and not isinstance(g.kv_cache_spec, MambaSpec)]
    sizes = {g.kv_cache_spec.block_size for g in groups}
    if odd:
        problem = (f"{'; '.join(odd)} {'is' if len(odd) == 1 else 'are'} neither full-attention nor sliding-window "
                   "KV, the kinds kvring loads "
                   f"{'into several KV-cache groups' if len(groups) > 1 else ''}").rstrip()
    elif len(sizes) > 1:
        problem = f"its KV-cache groups have block sizes {sorted(sizes)}, and kvring loads groups of one block size"
    else:
        return
    fix = ("Start vLLM with --disable-hybrid-kv-cache-manager (every layer keeps its full KV in one group, which "
           "kvring loads; it costs KV memory), or serve it without --kv-transfer-config" if len(groups) > 1
           else "Serve it without --kv-transfer-config")
    raise ValueError(f"KVRingConnector cannot serve this model without risking wrong KV: {problem}. {fix}.")


def check_state(vllm_config, groups: KVGroups) -> None:
    """Refuse a deployment of a model with recurrent state that kvring does not serve yet
    (``ValueError`` saying what to change): pipeline stages, and the GPU path of its copies."""
    if groups.state is None:
        return
    parallel = vllm_config.parallel_config
    problems = []
    if parallel.pipeline_parallel_size > 1:
        problems.append(f"pipeline parallel size {parallel.pipeline_parallel_size}")
    device = str(getattr(vllm_config.device_config, "device_type", "cpu"))
    if device != "cpu":
        problems.append(f"device {device}")
    if problems:
        raise ValueError(f"KVRingConnector cannot serve a model with recurrent state (Mamba, linear attention) with "
                         f"{' and '.join(problems)} yet: its state is loaded and saved on vLLM's CPU build, without "
                         "pipeline stages, so far. Serve it with --pipeline-parallel-size 1, or without "
                         "--kv-transfer-config.")


def state_block_size_advice(vllm_config, groups: KVGroups) -> str | None:
    """What to set so that vLLM hands over a model's recurrent state at its blocks' boundaries
    (``None``: nothing).  vLLM raises such a model's block size until an attention page holds a
    state, in its workers; unless ``--block-size`` gives it, vLLM 0.32's scheduler in an engine
    core of its own (``vllm serve``) keeps the platform's default, ends prefill steps on that
    size's boundaries, which are not the state's, and so hands over almost no state: prompts are
    computed, never loaded."""
    cache = vllm_config.cache_config
    if groups.state is None or cache.user_specified_block_size:
        return None
    return (f"KVRingConnector: start vLLM with --block-size {cache.block_size} (the block size it chose for this "
            "model's recurrent state): without it vLLM's scheduler ends prefill steps on its default block size "
            "when its engine core runs in a process of its own, hands over almost no state, and kvring stores "
            "almost none of this model's prompts")


def check_chunk_blocks(chunk_size: int, block_size: int) -> None:
    """Refuse a cluster whose chunks do not hold whole vLLM blocks: loads and saves would copy
    parts of blocks, and vLLM's CPU kernel keeps a block's K transposed behind the view connectors
    get, so part of a block is not a run of tokens (wrong KV, silently)."""
    if chunk_size % block_size:
        raise ValueError(f"KVRingConnector cannot serve this engine without risking wrong KV: the cluster's chunks "
                         f"hold {chunk_size} tokens, which is not a whole number of vLLM's {block_size}-token blocks. "
                         f"Start vLLM with a --block-size that divides {chunk_size}, or use a cluster whose chunk_size "
                         f"is a multiple of {block_size}.")


def _loadable(spec) -> bool:
    """Full attention (K and V per KV head), or MLA's latent: the caches kvring loads as one group."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if isinstance(spec, MLAAttentionSpec):
        return type(spec) is MLAAttentionSpec
    return isinstance(spec, FullAttentionSpec)


def worker_load_bytes(vllm_config, layout: KVLayout, groups: KVGroups | None = None) -> LoadBytes:
    """KV bytes the busiest worker loads for a hit: its heads of its stage's layers (the workers
    load in parallel, so this, not the whole token's, is what a load's time follows), of
    sliding-window layers only their window, and of recurrent-state layers one state."""
    parallel = vllm_config.parallel_config
    heads = len(RankShard.of_rank(layout.num_kv_heads, parallel.tensor_parallel_size, 0, (0, 0)).heads)
    per_layer = layout.bytes_per_token * heads // (layout.num_kv_heads * layout.num_layers)
    stage = max(chunk_parts(vllm_config, layout).stages, key=lambda s: s[1] - s[0])
    windows = layout.windows[stage[0]:stage[1]] or (0,) * (stage[1] - stage[0])
    state = groups.state if groups is not None else None
    return LoadBytes(per_layer * windows.count(0),
                     tuple((w, per_layer * windows.count(w)) for w in sorted(set(windows) - {0, STATE})),
                     state.nbytes * len(state.layer_names) if state else 0)


def check_parallel(vllm_config) -> None:
    """Refuse a parallel layout whose KV the connector cannot store and load right (``ValueError``
    saying why and what to change): context parallelism splits a request's tokens, not its heads
    or layers, over ranks, and kvring stores whole chunks of tokens per part."""
    parallel = vllm_config.parallel_config
    problems = [f"{name.replace('_', ' ')} {getattr(parallel, name)}"
                for name in ("decode_context_parallel_size", "prefill_context_parallel_size")
                if getattr(parallel, name, 1) > 1]
    if problems:
        raise ValueError("KVRingConnector cannot serve " + " and ".join(problems) + ": context parallelism "
                         "spreads a chunk's tokens over ranks and kvring stores a chunk's tokens together. Serve "
                         "it with --decode-context-parallel-size 1 --prefill-context-parallel-size 1 (tensor and "
                         "pipeline parallelism are served).")
    # Raises for a split of the KV heads vLLM itself would not make.
    RankShard.of_rank(_total_kv_heads(vllm_config.model_config), parallel.tensor_parallel_size, 0, (0, 0))
