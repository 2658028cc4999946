"""Run prompts through one real vLLM engine (CPU build), optionally with KVRingConnector.

A child-process entry point (vLLM starts its engine in a spawned process, and each instance
must be a separate process): ``python -P -m kvring.engine.run SPEC.json OUT.json``.  SPEC holds
the model dir, the prompts, and the connector settings (or none); OUT gets each prompt's greedy
output tokens, its time to first token and the tokens vLLM did not compute (``cached``: loaded
from kvring, or hit in vLLM's own prefix cache when that is on), and with ``logprobs`` set, each
generated token's top logprobs (``logprobs``: ``[{token: logprob}]``, the token a string).

SPEC (JSON)::

    {"model": DIR,                       # e.g. from write_tiny_llama
     "dtype": "bfloat16",                # optional; also the dtype of generated prompt embeds
     "max_model_len": 8192, "max_tokens": 8, "prefix_caching": false, "kv_cache_gib": 1,
     "logprobs": 0,                      # optional: keep each generated token's top N logprobs
     "block_size": 16,                   # optional: vLLM's KV block size (MLA on CPU needs 16)
     "disable_hybrid_kv_cache_manager": false,  # optional: one KV-cache group for every layer
     "max_num_batched_tokens": 8192,     # optional: tokens per step (default max_model_len); fewer
                                         #   than a prompt's: its prefill is chunked over steps
     "tensor_parallel_size": 1, "pipeline_parallel_size": 1,  # optional: workers in processes of
                                         #   their own, one CPU each (VLLM_CPU_OMP_THREADS_BIND)
     "in_process": false,                # optional: engine core and worker in this process (vLLM's
                                         #   VLLM_ENABLE_V1_MULTIPROCESSING=0 and its "uni" executor),
                                         #   TP 1 and PP 1 only; default: $KVRING_ENGINE_IN_PROCESS=1
     "connector": {...} | null,          # KVRingConnector's kv_connector_extra_config
     "lora": {                           # optional: LLM(enable_lora=True, ...)
         "max_rank": 8,                  # max_lora_rank (vLLM allows 1, 8, 16, 32, 64, ...)
         "adapters": {NAME: DIR},        # e.g. from write_random_lora
         "ids": {NAME: INT},             # optional: lora_int_id per adapter (>= 1); default
                                         #   1, 2, ... in the order of "adapters"
         "max_loras": INT},              # optional: default len(adapters)
     "prompt_embeds": false,             # true: LLM(enable_prompt_embeds=True)
     "prompts": [ITEM, ...]}

    ITEM = {"tokens": [int, ...]                      # a TokensPrompt
            | "embeds_seed": int, "embeds_len": int,  # an EmbedsPrompt of random_prompt_embeds()
            "salt": str,                              # optional cache_salt
            "lora": NAME}                             # optional: run under that adapter
         | {"batch": [ITEM, ...]}                     # these prompts in one generate call (at once)
         | {"signal": [PID, "SIGSTOP"]}               # send a signal (e.g. stop a cache node)
         | {"post": URL, "headers": {...}}            # an HTTP POST (e.g. a node's fault injection,
                                                      #   with the cluster's node token in a header)
         | {"reset_cache": true}                      # reset_prefix_cache(reset_connector=True): what
                                                      #   vLLM does after an in-place weight update
         | {"reset_local_cache": true}                # reset_prefix_cache(): vLLM's own prefix cache
                                                      #   only (the next run of a prompt asks kvring)
         | {"wait_for": PATH, "timeout": 1800}        # wait until the file PATH exists (a driver's go)
         | {"touch": PATH}                            # create the file PATH (tell a driver a step is done)

Each prompt gets one result, in order (a batch's prompts one each); actions get none.  Each
generate call (a prompt or a batch) also gets one entry in OUT's ``steps``: its prompts, its wall
time and the connector's counters after it (``counters``, read by ``connector_counters``:
cumulative, ``{}`` without a connector), so a driver can tell what the connector did during one
batch.

``wait_for`` and ``touch`` let a driver keep several engines alive and run their batches in
turn (``start_instance``): ``kvring bench miss`` alternates two engines that way.

The int ids are vLLM-process-local handles for the adapters (vLLM's LoRA manager keys its
loaded adapters by them); a correct cache must key by what the adapter is, never by its id,
so tests run the same adapter under different ids in different instances.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvring.common.contract import transfer_config
from kvring.common.errors import KVRingError

from .preload import engine_env
from .zygote import ForkedProcess, ZygoteError, zygote, zygote_enabled

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
_ACTIONS = {"signal", "post", "reset_cache", "reset_local_cache", "wait_for", "touch"}  # spec steps that run no prompt
IN_PROCESS_ENV = "KVRING_ENGINE_IN_PROCESS"  # "1": engines without a spec's "in_process" run in one process
# vLLM binds its IPC sockets at VLLM_RPC_BASE_PATH/<uuid4>; a Unix socket's path has at most 107 bytes.
IPC_BASE_MAX = 107 - len("/") - 36
_OWN_DIR = "/e-12345678"  # an instance's own temporary directory, as ``tempfile.mkdtemp`` names it


class EngineSetupError(KVRingError):
    """A vLLM instance cannot be started here; the message says why and what to do."""


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


def write_tiny_sliding_llama(path: Path, layer_types: Sequence[str], window: int, hidden: int = 256, heads: int = 4,
                             kv_heads: int = 2, vocab: int = 2048, seed: int = 0) -> Path:
    """A small random-weight Llama whose layers are ``"sliding_attention"`` (a window of ``window``
    tokens) or ``"full_attention"``, as ``layer_types`` says (Mistral- or gpt-oss-style windows)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=len(layer_types),
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=16384, torch_dtype="float32", sliding_window=window,
                         layer_types=list(layer_types))
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def write_tiny_gemma3(path: Path, layers: int = 6, window: int = 512, hidden: int = 256, heads: int = 4,
                      kv_heads: int = 1, head_dim: int = 64, vocab: int = 2048, seed: int = 0) -> Path:
    """A small random-weight Gemma 3 (text): five sliding-window layers to one full-attention
    layer, a local and a global RoPE base, query-key norms, as the released configs have."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                              head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=window,
                              max_position_embeddings=16384, torch_dtype="float32")
    Gemma3ForCausalLM(config).save_pretrained(path)
    return path


def write_tiny_deepseek(path: Path, layers: int = 2, hidden: int = 256, heads: int = 4, vocab: int = 2048,
                        seed: int = 0) -> Path:
    """A small random-weight DeepSeek-V2 (MLA attention, one dense MLP per layer), saved locally.

    vLLM's CPU MLA backend takes one latent of 576 per token (``kv_lora_rank`` 512 + rope 64)
    and a block size of 16; it runs float32 (and turns vLLM's own prefix caching off)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                              moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=heads,
                              num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=4,
                              num_experts_per_tok=2, first_k_dense_replace=layers, kv_lora_rank=512, q_lora_rank=None,
                              qk_rope_head_dim=64, v_head_dim=64, qk_nope_head_dim=64,
                              max_position_embeddings=16384, torch_dtype="float32")
    DeepseekV2ForCausalLM(config).save_pretrained(path)
    return path


def write_tiny_qwen3_next(path: Path, layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
                          vocab: int = 2048, seed: int = 0) -> Path:
    """A small random-weight Qwen3-Next: gated-delta-net layers (linear attention, a recurrent
    state per request) with a full-attention layer every second one, and a mixture of experts.
    vLLM's CPU gated delta net runs bfloat16 only (its state float32)."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64,
                             linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=hidden // 2, shared_expert_intermediate_size=hidden // 2,
                             decoder_sparse_step=1, full_attention_interval=2, max_position_embeddings=16384,
                             torch_dtype="bfloat16")
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _model_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def write_random_lora(path: Path, base_model_dir: Path, rank: int = 8, seed: int = 0,
                      target_modules: Sequence[str] = LORA_TARGETS, strength: float = 2.0) -> Path:
    """A random-weight LoRA adapter for the Llama in ``base_model_dir``, in PEFT's format (no peft needed).

    Writes ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's tensor names
    (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``, shape ``[rank, in]``;
    ``...lora_B.weight``, shape ``[out, rank]``) for the attention projections in
    ``target_modules`` (any of q/k/v/o_proj) of every layer.  ``lora_alpha = rank``, so vLLM's
    scaling is 1 and each projection's update ``B @ A`` has entries of standard deviation
    ``strength * initializer_range``: ``strength`` times the base weights' (random) scale, so an
    adapter clearly changes the layers' K/V and the greedy outputs.
    """
    import torch
    from safetensors.torch import save_file

    cfg = _model_config(base_model_dir)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden)}  # (in, out)
    unknown = set(target_modules) - set(shapes)
    if unknown:
        raise ValueError(f"unsupported LoRA target modules {sorted(unknown)}; supported: {sorted(shapes)}")
    b_std = strength * cfg.get("initializer_range", 0.02) / rank ** 0.5  # std(B @ A) = sqrt(rank) * 1 * b_std
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module in target_modules:
            fan_in, fan_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * b_std
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model_dir),
        "r": rank, "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
        "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None,
        "target_modules": list(target_modules)}, indent=2))
    return path


def random_prompt_embeds(model_dir: Path, seed: int, length: int, dtype: str = "bfloat16") -> torch.Tensor:
    """Deterministic random prompt embeddings ``[length, hidden]`` for the model in ``model_dir``.

    Drawn like the rows of a freshly initialized embedding table (normal, standard deviation
    ``initializer_range``) from ``seed`` alone, so any process regenerates the same tensor.
    """
    import torch

    cfg = _model_config(model_dir)
    gen = torch.Generator().manual_seed(seed)
    embeds = torch.randn(length, cfg["hidden_size"], generator=gen) * cfg.get("initializer_range", 0.02)
    return embeds.to(_torch_dtype(dtype, cfg))


def native_dtype() -> str:
    """``"bfloat16"`` where the CPU computes it natively (AVX-512 BF16 or AMX), else
    ``"float32"``: with AVX2 alone, PyTorch's bfloat16 matrix products run about a hundred times
    slower than float32 ones (one 4096x1024x11008 product: 100 s against 0.8 s, 2 cores)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "bfloat16"
    return "bfloat16" if "avx512_bf16" in flags or "amx_bf16" in flags else "float32"


def _torch_dtype(dtype: str, cfg: dict[str, Any]) -> torch.dtype:
    """The torch dtype vLLM runs the model in for ``dtype`` (``"auto"``: the checkpoint's)."""
    import torch

    if dtype == "auto":
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return {"half": torch.float16, "float": torch.float32}.get(dtype) or getattr(torch, dtype)


def run_instance(tmp: Path, name: str, spec: dict) -> dict:
    """Run ``spec`` in a vLLM instance of its own (a child process) to the end; its OUT as a dict.

    Whatever ends the wait (the instance failing, an exception, Ctrl-C, ``Stopped``), the
    instance and every process it started are stopped before this returns or raises."""
    instance = start_instance(tmp, name, spec)
    try:
        return instance.result()
    finally:
        instance.stop()


class Instance:
    """A vLLM instance running a spec in a child process of its own session (``start_instance``).

    Its output (vLLM's log) goes to ``TMP/NAME.log``.  The child's (and vLLM's) temporary files
    (IPC sockets, rendezvous files, torch's inductor cache) go under ``tmpdir`` if set, else in a
    directory of the instance's own inside this process's temporary directory
    (``tempfile.gettempdir()``: the run's directory inside ``kvring.local.rundir.run_directory``),
    removed by ``stop``, since a vLLM process that is stopped leaves its IPC sockets behind (where
    that directory's name would make a socket path too long, the temporary directory itself).
    ``TMPDIR`` and vLLM's ``VLLM_RPC_BASE_PATH`` point there.  ``env`` adds environment variables
    (e.g. vLLM's ``VLLM_CPU_OMP_THREADS_BIND``).
    """

    def __init__(self, tmp: Path, name: str, spec: dict, tmpdir: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        import subprocess

        self.name, self.log, self.out = name, tmp / f"{name}.log", tmp / f"{name}.out"
        scratch = str(tmpdir) if tmpdir else tempfile.gettempdir()
        self._own: Path | None = None
        if tmpdir is None and len(scratch.encode()) + len(_OWN_DIR) <= IPC_BASE_MAX:
            self._own = Path(tempfile.mkdtemp(prefix="e-", dir=scratch))
            scratch = str(self._own)
        if len(scratch.encode()) > IPC_BASE_MAX:
            raise EngineSetupError(f"vLLM's IPC sockets cannot live under {scratch} ({len(scratch.encode())} bytes; a "
                                   f"socket path holds at most 107): point TMPDIR at a shorter directory, e.g. /tmp")
        (tmp / f"{name}.json").write_text(json.dumps(spec))
        env = {**engine_env({**os.environ, **(env or {})}), "TMPDIR": scratch, "VLLM_RPC_BASE_PATH": scratch}
        argv = [str(tmp / f"{name}.json"), str(self.out)]
        self.proc: subprocess.Popen | ForkedProcess | None = None
        if zygote_enabled():
            try:
                self.proc = zygote(engine_env()).spawn(argv, str(self.log), env)
            except ZygoteError as exc:
                logger.warning("vLLM instance %s: %s; starting it as a process of its own", name, exc)
        if self.proc is None:
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen([sys.executable, "-P", "-m", "kvring.engine.run", *argv], stdout=log,
                                             stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def check(self) -> None:
        """Raise if the instance has exited with an error (the end of its log in the message)."""
        code = self.proc.poll()
        if code:
            tail = self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""
            raise RuntimeError(f"vLLM instance {self.name!r} failed (exit {code}):\n{tail}")

    def wait_file(self, path: Path, timeout: float) -> None:
        """Wait until the instance creates ``path`` (a ``touch`` step); raise if it exits first."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            self.check()
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM instance {self.name!r} exited before {path.name}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM instance {self.name!r}: no {path.name} within {timeout:.0f} s")
            time.sleep(0.05)

    def result(self, timeout: float | None = None) -> dict:
        """Wait for the instance to finish; its OUT as a dict."""
        self.proc.wait(timeout)
        self.check()
        return json.loads(self.out.read_text())

    def stop(self) -> None:
        """End the instance and every process it started (its session), if still running."""
        from kvring.local.cluster import stop_process_group

        stop_process_group(self.proc, timeout=15)
        if self._own is not None:
            shutil.rmtree(self._own, ignore_errors=True)


def start_instance(tmp: Path, name: str, spec: dict, tmpdir: Path | None = None,
                   env: dict[str, str] | None = None) -> Instance:
    """Start ``spec`` in a vLLM instance of its own (a child process) and return at once."""
    return Instance(tmp, name, spec, tmpdir, env)


def connector_counters() -> dict[str, float]:
    """The connector's counters as vLLM's Prometheus metrics hold them in this process (cumulative).

    ``{name: value}`` for every ``vllm:kvring_<name>_total`` series, summed over labels (engines,
    and for ``failed_blocks`` and ``loads_refused`` the reasons, which also get an entry each:
    ``"loads_refused:slower"``); ``{}`` when the engine has no connector.  Read from
    prometheus_client's registry directly: ``LLM.get_metrics()`` returns the same series but
    truncates every counter to an int (vLLM's ``v1/metrics/reader.py``), which turns seconds
    such as ``scheduler_hook_seconds`` into 0.
    """
    from prometheus_client import REGISTRY

    counters: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if metric.type != "counter" or not metric.name.startswith("vllm:kvring_"):
            continue
        name = metric.name.removeprefix("vllm:kvring_")
        totals = [s for s in metric.samples if s.name.endswith("_total")]
        counters[name] = sum(s.value for s in totals)
        for s in totals:
            if "reason" in s.labels:
                key = f"{name}:{s.labels['reason']}"
                counters[key] = counters.get(key, 0.0) + s.value
    return counters


def decision_between(before: dict[str, float], after: dict[str, float]) -> str:
    """What the connector did for one prompt, from its ``connector_counters`` before and after it
    (the prompt alone in its generate call): ``lookup past deadline`` or ``lookup failed`` (a
    miss), ``refused (<reason>)`` (admission), ``abandoned`` (a load past its deadline), ``load failed``
    (its blocks recomputed), ``loaded (probe)``, ``loaded`` or ``miss``."""
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    if delta.get("lookups_past_deadline"):
        return "lookup past deadline"
    if delta.get("lookup_errors"):
        return "lookup failed"
    for reason in ("node_failing", "slower"):
        if delta.get(f"loads_refused:{reason}"):
            return f"refused ({reason})"
    if delta.get("loads_abandoned"):
        return "abandoned"
    if delta.get("failed_blocks"):
        return "load failed"
    if delta.get("load_probes"):
        return "loaded (probe)"
    return "loaded" if delta.get("hit_tokens") else "miss"


def _lora_requests(lora: dict) -> dict[str, Any]:
    """One ``LoRARequest`` per adapter of ``spec["lora"]``, with its int id (given, or 1, 2, ... in order)."""
    from vllm.lora.request import LoRARequest

    ids = lora.get("ids") or {}
    if len(set(ids.values())) != len(ids):
        raise ValueError(f"LoRA ids must be distinct: {ids}")
    return {name: LoRARequest(name, int(ids.get(name, i + 1)), str(path))
            for i, (name, path) in enumerate(lora["adapters"].items())}


def _prompt(spec: dict, item: dict) -> dict:
    """The vLLM prompt (a ``TokensPrompt`` or an ``EmbedsPrompt``) of one spec item."""
    from vllm.inputs import EmbedsPrompt, TokensPrompt

    salt = {"cache_salt": item["salt"]} if item.get("salt") else {}
    if "embeds_seed" in item:
        embeds = random_prompt_embeds(Path(spec["model"]), item["embeds_seed"], item["embeds_len"],
                                      spec.get("dtype", "bfloat16"))
        return EmbedsPrompt(prompt_embeds=embeds, **salt)
    return TokensPrompt(prompt_token_ids=item["tokens"], **salt)


def _prompt_items(items: list[dict]) -> list[dict]:
    """The prompt items of a spec's list, batches opened, actions left out."""
    out = []
    for item in items:
        if "batch" in item:
            out.extend(item["batch"])
        elif not _ACTIONS & set(item):
            out.append(item)
    return out


def engine_kwargs(spec: dict) -> dict[str, Any]:
    """``LLM(**engine_kwargs(spec))``: the engine a spec runs (also what ``layout_of`` configures)."""
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if spec.get("connector"):
        extra = dict(spec["connector"])
        kw["kv_transfer_config"] = KVTransferConfig(**transfer_config(extra.pop("etcd"), extra.pop("cluster", "default"),
                                                                      **extra))
    if spec.get("lora"):
        kw.update(enable_lora=True, max_lora_rank=spec["lora"].get("max_rank", 8),
                  max_loras=spec["lora"].get("max_loras", len(spec["lora"]["adapters"])))
    if spec.get("prompt_embeds"):
        kw["enable_prompt_embeds"] = True
    tp, pp = spec.get("tensor_parallel_size", 1), spec.get("pipeline_parallel_size", 1)
    if tp * pp > 1:
        kw.update(tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp")
    elif in_process(spec):
        kw["distributed_executor_backend"] = "uni"
    if spec.get("block_size"):
        kw["block_size"] = spec["block_size"]
    if spec.get("disable_hybrid_kv_cache_manager"):
        kw["disable_hybrid_kv_cache_manager"] = True
    if spec.get("mamba_cache_mode"):
        kw["mamba_cache_mode"] = spec["mamba_cache_mode"]
    if pp > 1:
        # vLLM's CPU runner allocates a later stage's input buffers in its warm-up, which it runs
        # only for a compiled model: eager it asserts on its first step.  Dynamo traced once with
        # the eager backend warms up without compiling anything.
        kw["compilation_config"] = {"mode": 2, "backend": "eager"}
    return dict(model=spec["model"], skip_tokenizer_init=True, enforce_eager=pp == 1,
                dtype=spec.get("dtype", "bfloat16"),
                enable_prefix_caching=spec.get("prefix_caching", False),
                max_model_len=spec.get("max_model_len", 8192),
                max_num_batched_tokens=spec.get("max_num_batched_tokens", spec.get("max_model_len", 8192)),
                gpu_memory_utilization=0.5, seed=0,
                disable_log_stats=False, **kw)


def in_process(spec: dict) -> bool:
    """Whether ``spec``'s engine runs in one process: its ``in_process``, else
    ``$KVRING_ENGINE_IN_PROCESS`` (the test suite sets it: each engine start then imports vLLM
    once instead of three times, ~20 s less on 2 cores); never with several workers.  By default
    an engine runs as ``vllm serve`` does, its core and worker in processes of their own."""
    tp, pp = spec.get("tensor_parallel_size", 1), spec.get("pipeline_parallel_size", 1)
    return tp * pp == 1 and spec.get("in_process", os.environ.get(IN_PROCESS_ENV) == "1")


def layout_of(spec: dict, chunk_size: int):
    """The ``KVLayout`` the connector of ``spec``'s engine keys chunks in, without starting it.

    Tests use it to pick prompts by the nodes that own their chunks.
    """
    from vllm.engine.arg_utils import EngineArgs

    kw = engine_kwargs({**spec, "connector": None})
    return _layout(EngineArgs(**kw).create_engine_config(), chunk_size)


def _layout(vllm_config, chunk_size: int, groups=None):
    """The connector's layout for an engine of ``vllm_config``, as seen from outside its processes.

    The connector reads each layer's kind from the KV-cache groups vLLM gives it in the
    engine's processes: ``groups`` (``KVGroups``), where the caller has them (an engine whose
    core runs in this process).  Without them, sliding windows are read off the model's config
    (``layer_types`` and ``sliding_window``, as the Llama, Gemma 2/3, gpt-oss and Mistral configs
    give them) when vLLM keeps its hybrid KV-cache manager on; a model with recurrent state then
    has no layout here (``None``: its state's format is known in the engine only).
    """
    from kvring.connector.instance import KVGroups, layout_from_vllm

    if groups is not None:
        return layout_from_vllm(vllm_config, chunk_size, groups=groups)
    if vllm_config.model_config.is_hybrid:
        return None

    text = vllm_config.model_config.hf_text_config
    window = getattr(text, "sliding_window", None)
    layers = vllm_config.model_config.get_total_num_hidden_layers()
    windows: tuple[int, ...] = ()
    if window and not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        types = getattr(text, "layer_types", None) or ["sliding_attention"] * layers
        windows = tuple(window if kind == "sliding_attention" else 0 for kind in types)
    return layout_from_vllm(vllm_config, chunk_size, groups=KVGroups({}, windows))


def run(spec: dict) -> dict:
    """Run the prompts of ``spec`` (format in the module docstring) one after another in one engine."""
    from vllm import LLM, SamplingParams

    kw = engine_kwargs(spec)
    lora_requests = _lora_requests(spec["lora"]) if spec.get("lora") else {}
    llm = LLM(**kw)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0, detokenize=False,
                            logprobs=spec.get("logprobs") or None)
    results, steps = [], []
    for step in spec["prompts"]:
        if "wait_for" in step:
            _wait_for(Path(step["wait_for"]), step.get("timeout", 1800))
            continue
        if "touch" in step:
            Path(step["touch"]).touch()
            continue
        if "signal" in step:
            pid, sig = step["signal"]
            os.kill(int(pid), getattr(signal, sig))
            continue
        if "post" in step:
            import urllib.request

            request = urllib.request.Request(step["post"], method="POST", headers=step.get("headers") or {})
            with urllib.request.urlopen(request, timeout=10) as resp:
                resp.read()
            continue
        if "reset_cache" in step or "reset_local_cache" in step:
            whole = "reset_cache" in step
            if not llm.reset_prefix_cache(reset_connector=whole):
                raise RuntimeError(f"reset_prefix_cache(reset_connector={whole}) failed")
            continue
        batch = step.get("batch") or [step]
        prompts = [_prompt(spec, item) for item in batch]
        loras = [lora_requests[item["lora"]] if item.get("lora") else None for item in batch]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False,
                            lora_request=loras if any(loras) else None)
        t1 = time.perf_counter()
        for out in outs:
            metrics = getattr(out, "metrics", None)
            result = {"tokens": list(out.outputs[0].token_ids), "seconds": t1 - t0,
                      "ttft": getattr(metrics, "first_token_latency", None) if metrics else None,
                      "cached": getattr(out, "num_cached_tokens", None)}
            if params.logprobs:
                result["logprobs"] = top_logprobs(out.outputs[0])
            results.append(result)
        steps.append({"prompts": len(outs), "seconds": t1 - t0,
                      "counters": connector_counters() if spec.get("connector") else {}})
    keys: list[list[str] | None] = []
    layout_fields = parts = layout = None
    if spec.get("connector"):
        from kvring.cachenode.client import ClusterClient
        from kvring.connector.instance import KVGroups, chunk_parts
        from kvring.connector.keys import KeyScope, request_keys

        vllm_config = llm.llm_engine.vllm_config
        cache_config = _kv_cache_config(llm)
        groups = (KVGroups.of(cache_config, vllm_config.model_config.get_total_num_hidden_layers())
                  if cache_config is not None else None)
        with ClusterClient(spec["connector"]["etcd"], cluster=spec["connector"].get("cluster", "default")) as c:
            layout = _layout(vllm_config, c.contract.chunk_size, groups)
    if layout is not None:
        # (head, first layer, end layer[, window]): ChunkPart(*coords); the window of a hybrid layout only
        parts = [dataclasses.astuple(p)[:3 if p.window is None else 4]
                 for p in chunk_parts(vllm_config, layout, groups).parts]
        # Keys of plain token prompts only: how the connector keys a prompt under an adapter or
        # given as embeddings is the connector's business, so those items get None.
        keys = [[k.hex() for k in request_keys(layout, item["tokens"], KeyScope(cache_salt=item.get("salt") or ""))]
                if "tokens" in item and not item.get("lora") else None for item in _prompt_items(spec["prompts"])]
        layout_fields = dataclasses.asdict(layout)
    # keys: each prompt's chunk keys; parts: the coordinates of each part a chunk is stored as
    # (``kvring.connector.parts``).
    return {"results": results, "keys": keys, "layout": layout_fields, "parts": parts, "steps": steps}


def top_logprobs(completion) -> list[dict[str, float]]:
    """A completion's top logprobs per generated token, as JSON keeps them: ``{token: logprob}``
    with the token a string."""
    return [{str(t): lp.logprob for t, lp in step.items()} for step in completion.logprobs or []]


def _kv_cache_config(llm):
    """The KV-cache groups of an engine whose core runs in this process (else ``None``)."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    return getattr(getattr(core, "scheduler", None), "kv_cache_config", None)


def _bind_workers(workers: int) -> None:
    """vLLM's CPU build binds each worker's OpenMP threads to the CPUs of its entry in
    ``VLLM_CPU_OMP_THREADS_BIND`` ("0|1": one each); with several workers, give each one CPU of
    this process's, round robin, unless a binding with one entry per worker is set already."""
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if workers > 1 and len(bind.split("|")) != workers:
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[i % len(cpus)]) for i in range(workers))


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s (is the driver gone?)")
        time.sleep(0.02)


def main(argv: list[str]) -> None:
    """An instance's process: ``argv`` is ``[SPEC, OUT]`` (a spawned one's, or a zygote's child's)."""
    spec = json.loads(Path(argv[0]).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 1)))
    _bind_workers(spec.get("tensor_parallel_size", 1) * spec.get("pipeline_parallel_size", 1))
    if in_process(spec):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when vLLM builds the engine
    Path(argv[1]).write_text(json.dumps(run(spec)))


if __name__ == "__main__":
    main(sys.argv[1:])
