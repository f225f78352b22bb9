"""PromptCacheConnector: vLLM's KV connector interface over the two halves of this package.

vLLM builds one instance in its scheduler (`role=SCHEDULER`: `SchedulerSide`) and one in
each worker (`role=WORKER`: `WorkerSide`); this class only translates vLLM's objects into
theirs. It refuses to start when a failed load would fail the request (vLLM's default
`kv_load_failure_policy` "fail"), and is disabled, with one log line, for set-ups it cannot
serve exactly (platforms other than CPU and CUDA, hybrid KV cache groups, pipeline or context
parallelism, packed or sparse KV); a disabled connector loads and stores nothing, and vLLM
runs as without it. On CUDA it runs, saying once at start that no GPU engine has run it yet.
With tensor parallelism each rank's worker moves its own shard under its own namespace, and
the scheduler offers a hit only for what every rank holds; MLA's latent KV, the same on every
rank, is stored once by rank 0 and loaded by all.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.version import __version__ as vllm_version

from cache_service.client import CacheClient
from cache_service.integrations.vllm.counters import Counters, merged
from cache_service.integrations.vllm.layout import EngineLayout
from cache_service.integrations.vllm.notes import RateLimitedLog, connector_logger
from cache_service.integrations.vllm.options import ConnectorOptions, OptionError
from cache_service.integrations.vllm.plan import StepPlan
from cache_service.integrations.vllm.requests import PromptRequest, ScheduledRequest
from cache_service.integrations.vllm.scheduler_side import SchedulerSide
from cache_service.integrations.vllm.stats import PromptCachePromMetrics, PromptCacheStats
from cache_service.integrations.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = connector_logger(__name__)
NOTES = RateLimitedLog(logger)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# The counts every tensor-parallel rank reports (they add up); rank 0 alone reports the rest.
RANK_SUMS = ("loaded_bytes", "load_seconds", "stored_bytes", "store_seconds", "engine_seconds")


class PromptCacheMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, as vLLM hands it from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class WorkerStopped(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """A worker's word to the scheduler that it refused vLLM's KV cache layout, and why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Either worker's refusal stops the connector."""
        return self


class PromptCacheConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Loads vLLM's prefix KV from the prompt cache service and stores what vLLM computes."""

    _live: ClassVar[weakref.WeakSet[PromptCacheConnector]] = weakref.WeakSet()

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError(
                'PromptCacheConnector needs "kv_load_failure_policy": "recompute" at the top '
                'level of --kv-transfer-config: under the default "fail", a block the cache '
                "could not load would fail the request instead of being computed"
            )
        try:
            options = ConnectorOptions.from_extra_config(transfer.kv_connector_extra_config)
        except OptionError as exc:
            raise ValueError(str(exc)) from None
        self.options = replace(options, load_mode=load_mode(vllm_config, options))
        self.counters = Counters()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._load_failed = False
        self._worker_stopped = False
        self._rank = 0  # the worker's tensor-parallel rank
        self._num_blocks = 0
        disabled = _unsupported(vllm_config, kv_cache_config)
        if disabled:
            logger.error(
                "PromptCacheConnector disabled (it loads and stores nothing): %s", disabled
            )
            return
        self.layout = engine_layout(vllm_config, kv_cache_config, self.options)
        self.layout.for_lora("any adapter").namespace_name  # noqa: B018 (too long: fail at start)
        if self.layout.device != "cpu":
            logger.warning(
                "PromptCacheConnector on %s: this configuration has not been verified on a GPU "
                "engine yet (docs/content/vllm-connector.md, what runs where)",
                self.layout.device,
            )
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                options=self.options,
                layout=self.layout,
                client=self._client(self.options.lookup_timeout_seconds),
                counters=self.counters,
                role_load=transfer.is_kv_consumer,
                role_store=transfer.is_kv_producer,
            )
        else:
            self._rank = worker_rank()
            self._num_blocks = kv_cache_config.num_blocks
            self._worker = WorkerSide(
                layout=self.layout,
                rank=self._rank,
                client=self._client(self.options.transfer_timeout_seconds, loads=True),
                store_client=self._client(self.options.transfer_timeout_seconds),
                counters=self.counters,
                store_queue_bytes=self.options.store_queue_bytes,
                store_request_bytes=self.options.store_request_bytes,
            )
        logger.info(
            "PromptCacheConnector (%s) for %s, model %r, kv_layout %r, %s loads",
            role.name.lower(),
            self.options.url,
            self.layout.model,
            self.layout.namespace_name,
            self.options.load_mode,
        )
        PromptCacheConnector._live.add(self)

    @property
    def requires_kv_delivery(self) -> bool:
        """No: a store that does not happen is a later miss, never a lost result."""
        return False

    def _client(self, timeout_seconds: float, *, loads: bool = False) -> CacheClient:
        return CacheClient(
            self.options.url,
            api_key=self.options.api_key(),
            timeout=timeout_seconds,
            fail_open=True,
            backoff_max_seconds=self.options.backoff_max_seconds,
            local_reads=loads and self.options.local_reads,
            local_reads_path=self.options.local_reads_path or None,
        )

    @classmethod
    def totals(cls) -> dict[str, float]:
        """Every count of every connector in this process since start (offline `LLM` runs)."""
        total: dict[str, float] = {}
        for connector in list(cls._live):
            total = merged(total, connector.counters.totals())
        return total

    # Scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond vLLM's own hit that the service holds, or None while the lookup is
        under way; and whether they load asynchronously (`load_mode`)."""
        if self._scheduler is None:
            return 0, False
        try:
            matched = self._scheduler.matched_tokens(prompt_request(request), num_computed_tokens)
        except Exception as exc:  # a cache problem is a miss, never a failed request
            self.counters.miss("lookup_error")
            NOTES.warn(f"prompt cache lookup failed: {exc!r:.300}")
            return 0, False
        return matched, bool(matched) and self.options.load_mode == "async"

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Note which of the request's blocks the loaded tokens go into."""
        if self._scheduler is not None and num_external_tokens > 0:
            block_ids = list(blocks.get_block_ids()[0])
            self._scheduler.allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads and stores."""
        if self._scheduler is None:
            return PromptCacheMetadata(StepPlan())
        return PromptCacheMetadata(self._scheduler.plan_step(scheduled_requests(scheduler_output)))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Offer nothing more to a request whose load failed; stop offering hits when a worker
        could not take vLLM's KV cache layout."""
        failed = connector_output.invalid_block_ids
        if self._scheduler is not None and failed:
            self._scheduler.load_failed(set(failed))
        meta = connector_output.kv_connector_worker_meta
        if self._scheduler is not None and isinstance(meta, WorkerStopped):
            self._scheduler.stop(f"a worker refused vLLM's KV cache: {meta.reason}")
            self._scheduler = None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its blocks are free at once (stores copy them out first). A
        prefill engine's request (`do_remote_decode`) answers with what was stored of it."""
        if self._scheduler is None:
            return False, None
        return False, self._scheduler.finished(request.request_id)

    def reset_cache(self) -> bool:
        """Stop loading and storing until restart. vLLM resets its connector's cache when its
        weights may change (a weight sync pauses the scheduler with clear_cache): KV stored
        under this namespace would then no longer match. The shared store is not purged: it
        serves every engine, and purging is an operator's call (POST /v1/purge)."""
        if self._scheduler is not None:
            self._scheduler.stop("vLLM reset the connector's cache (weights may have changed)")
            self._scheduler = None
        return True

    # Worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the paged KV cache of every layer."""
        if self._worker is not None:
            self._worker.register(kv_caches, num_blocks=self._num_blocks)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads (asynchronous), or load them before the forward."""
        if self._worker is None:
            return
        with self._on_engine_thread():
            if self.options.load_mode == "async":
                self._worker.load_async(self._plan())
            else:
                self._load_failed = bool(self._worker.load(self._plan()))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous load ended (their failed blocks are reported in the
        same pass); nothing is ever held for sending."""
        if self._worker is None:
            return None, None
        with self._on_engine_thread():
            return None, self._worker.finished_loads() or None

    @contextmanager
    def _on_engine_thread(self) -> Iterator[None]:
        """Count the time a call takes on vLLM's own thread (`engine_seconds`)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.counters.add("engine_seconds", time.perf_counter() - started)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a load holds every layer of its blocks before vLLM reads them."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: completed blocks are copied out of every layer at the step's end."""

    def wait_for_save(self) -> None:
        """Copy the step's completed groups out and queue their stores."""
        if self._worker is not None:
            with self._on_engine_thread():
                self._worker.save(self._plan(), skip=self._load_failed)
            self._load_failed = False

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks vLLM must recompute: their load failed (missing, refused, unreadable)."""
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Once, if this worker refused vLLM's KV cache: the scheduler then stops offering hits."""
        if self._worker is None or self._worker.enabled or self._worker_stopped:
            return None
        self._worker_stopped = True
        return WorkerStopped(self._worker.refusal)

    def shutdown(self) -> None:
        """Let queued stores finish."""
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    def _plan(self) -> StepPlan:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, PromptCacheMetadata)
        return metadata.plan

    # Stats -------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> PromptCacheStats | None:
        """The counts since vLLM last asked. vLLM adds up every rank's: ranks past 0 move the
        same blocks (their own shards), so they report only what adds up, bytes and seconds."""
        fresh = self.counters.take()
        if self._rank:
            fresh = {name: fresh[name] for name in RANK_SUMS if name in fresh}
        return PromptCacheStats(data=fresh) if fresh else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PromptCacheStats:
        """Stats from the counts a worker or scheduler sent."""
        return PromptCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PromptCachePromMetrics:
        """The connector's Prometheus counters, beside vLLM's own."""
        return PromptCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


# vLLM's objects into the halves' ------------------------------------------------------------


def prompt_request(request: Request) -> PromptRequest:
    """What the scheduler half needs of a vLLM request."""
    lora = request.lora_request
    return PromptRequest(
        request_id=request.request_id,
        prompt_tokens=list(request.prompt_token_ids or ()),
        cache_salt=request.cache_salt or "",
        lora=f"{lora.lora_name}@{lora.lora_path}" if lora is not None else "",
        kv_transfer_params=request.kv_transfer_params,
        multimodal=bool(request.mm_features),
        prompt_embeds=request.prompt_embeds is not None,
    )


def scheduled_requests(output: SchedulerOutput) -> list[ScheduledRequest]:
    """Every request of a step with its new blocks and computed tokens."""
    scheduled = output.num_scheduled_tokens
    steps = [
        ScheduledRequest(
            request_id=new.req_id,
            new_block_ids=list(new.block_ids[0]),
            replaces_blocks=True,
            computed_tokens=new.num_computed_tokens,
            scheduled_tokens=scheduled.get(new.req_id, 0),
        )
        for new in output.scheduled_new_reqs
    ]
    cached = output.scheduled_cached_reqs
    for index, request_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[index]
        steps.append(
            ScheduledRequest(
                request_id=request_id,
                new_block_ids=list(new_ids[0]) if new_ids is not None else None,
                replaces_blocks=request_id in cached.resumed_req_ids,
                computed_tokens=cached.num_computed_tokens[index],
                scheduled_tokens=scheduled.get(request_id, 0),
            )
        )
    return steps


def load_mode(vllm_config: VllmConfig, options: ConnectorOptions) -> str:
    """The load mode `auto` stands for here: asynchronous loads, except on vLLM's CPU backend
    without async scheduling, where synchronous ones were measured faster (a 1,024-token
    prompt 96% cached: 2.0 s against 3.3 s) and are safe (the V1 model runner recovers a
    failed synchronous load in the step that saw it)."""
    from vllm.platforms import current_platform  # noqa: PLC0415 (picks the platform)

    if options.load_mode != "auto":
        return options.load_mode
    async_scheduling = getattr(vllm_config.scheduler_config, "async_scheduling", False)
    return "sync" if current_platform.is_cpu() and not async_scheduling else "async"


def worker_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a tensor-parallel group)."""
    from vllm.distributed.parallel_state import (  # noqa: PLC0415 (after vLLM's distributed init)
        get_tensor_model_parallel_rank,
    )

    return int(get_tensor_model_parallel_rank())


def _unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """Why this connector cannot serve the engine exactly, or ""."""
    from vllm.platforms import current_platform  # noqa: PLC0415 (picks the platform)

    parallel = vllm_config.parallel_config
    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        return (
            f"only vLLM's CPU and CUDA platforms are supported, not {current_platform.device_type}"
            " (docs/content/vllm-connector.md: what runs where)"
        )
    sizes = (
        parallel.pipeline_parallel_size,
        getattr(parallel, "prefill_context_parallel_size", 1),
        getattr(parallel, "decode_context_parallel_size", 1),
    )
    if any(size != 1 for size in sizes):
        return "pipeline or context parallelism above 1 is not supported yet"
    mode = vllm_config.kv_transfer_config.kv_connector_extra_config.get("load_mode")
    if getattr(vllm_config.scheduler_config, "async_scheduling", False) and mode == "sync":
        return 'async scheduling needs load_mode "async" (a failed load\'s next step runs first)'
    if mode == "sync" and not current_platform.is_cpu() and vllm_config.use_v2_model_runner:
        return (  # vllm issue #49250: the V2 runner rewinds only its CPU copy of the positions
            'vLLM\'s V2 model runner needs load_mode "async": it recomputes a failed synchronous '
            "load from the wrong position (or set VLLM_USE_V2_MODEL_RUNNER=0)"
        )

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return "models with other than one KV cache group (hybrid models) are not supported"
    if tp_replicas(kv_cache_config) not in (1, parallel.tensor_parallel_size):
        return f"KV replicated over {kv_cache_config.kv_tp_replicas} ranks of a tensor group"
    return unsupported_spec(groups[0].kv_cache_spec)


def unsupported_spec(spec: Any) -> str:
    """Why a KV cache group's spec is not one whose pages this connector moves, or ""."""
    from vllm.v1.kv_cache_interface import KVQuantMode  # noqa: PLC0415 (0.32's spec fields)

    kind = type(spec).__name__
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        return f"only full attention and MLA are supported, not {kind}"
    if spec.kv_quant_mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
        return f"KV quantisation {spec.kv_quant_mode.name} (packed, with scales) is not supported"
    if spec.num_head_slots is not None or spec.state_content_bytes is not None:
        return f"{kind} with packed page content is not supported"
    if spec.page_size_padded is not None or spec.tokens_per_state != 1:
        return f"{kind} with padded pages or several tokens a state is not supported"
    if isinstance(spec, MLAAttentionSpec) and (
        spec.model_version is not None or (spec.cache_dtype_str or "auto").endswith("_ds_mla")
    ):
        return f"sparse MLA ({spec.model_version or spec.cache_dtype_str}) is not supported"
    return ""


def tp_replicas(kv_cache_config: KVCacheConfig) -> int:
    """Consecutive tensor-parallel ranks that hold the same KV (MLA's latent: all of them)."""
    return int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1)


def engine_layout(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, options: ConnectorOptions
) -> EngineLayout:
    """The running engine's layout (rank 0's): what a stored block must match to be loaded."""
    from vllm.platforms import current_platform  # noqa: PLC0415 (picks the platform)

    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    model_config = vllm_config.model_config
    served = model_config.served_model_name
    name = options.model or (served[0] if isinstance(served, list) else served)
    backend, isa = attention_backend(vllm_config, spec)
    weights = options.weights_id or weights_digest(model_config.model, model_config.revision)
    if model_config.quantization:  # quantised on load: the files' digest is the same
        weights += f";q={model_config.quantization}"
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    return EngineLayout(
        model=str(name),
        weights=weights,
        engine_version=vllm_version,
        device=str(current_platform.device_type),
        backend=backend,
        kv_cache_layout=kv_cache_config.kv_cache_layout or "LBHNC",  # 0.32 always names it
        isa=isa,
        # fp8_e4m3 and fp8_e5m2 are both uint8 tensors: the cache dtype's name tells them apart
        kv_dtype=str(spec.dtype).removeprefix("torch.") if cache_dtype == "auto" else cache_dtype,
        layers=len(group.layer_names),
        kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        engine_block_tokens=spec.block_size,
        block_bytes=spec.page_size_bytes * len(group.layer_names),
        tp_rank=0,
        tp_size=tp_size,
        tp_replicated=tp_size > 1 and tp_replicas(kv_cache_config) == tp_size,
    )


def attention_backend(vllm_config: VllmConfig, spec: Any) -> tuple[str, str]:
    """The attention backend's name and, on CPU, the kernel's instruction set. The scheduler
    builds no layers, so this follows vLLM's own choice (`CpuPlatform.get_attn_backend_cls`).
    On CUDA the name is the kind of KV, not the backend: 0.32's CUDA backends for full
    attention (FLASH_ATTN, FLASHINFER, TRITON_ATTN: `do_kv_cache_update`) all write K and V into
    the same logical view, `(blocks, heads, tokens, 2 * head size)`, with
    `reshape_and_cache_flash` or its Triton twin, and its MLA backends write the latent with
    `concat_and_cache_mla` (`v1/attention/backend.py`); under one KV cache layout, dtype and
    block size their bytes are the same, so engines on different backends share blocks."""
    from vllm.platforms import current_platform  # noqa: PLC0415 (picks the platform)

    if not current_platform.is_cpu():
        return ("MLA" if isinstance(spec, MLAAttentionSpec) else "ATTN"), ""
    if isinstance(spec, MLAAttentionSpec):
        chosen = vllm_config.attention_config.backend
        amx = current_platform.get_cpu_architecture().name == "X86" and bool(
            torch.cpu._is_amx_tile_supported()
        )
        return ("AMX_MLA" if amx and getattr(chosen, "name", "") != "CPU_MLA" else "CPU_MLA"), ""
    from vllm.v1.attention.backends.cpu_attn import (  # noqa: PLC0415 (CPU builds only)
        _get_attn_isa,
    )

    cache_dtype = vllm_config.cache_config.cache_dtype
    isa = _get_attn_isa(
        vllm_config.model_config.dtype, spec.block_size, spec.head_size, cache_dtype
    )
    return "CPU_ATTN", str(isa)


def weights_digest(model: str, revision: str | None) -> str:
    """xxh3-128 of a local model folder's config and weight files; for a hub name, the name
    and revision (set `weights_id` to name the weights exactly)."""
    folder = Path(model)
    if not folder.is_dir():
        name = f"{model}@{revision or 'default'}"
        return f"hub:{xxhash.xxh3_64_hexdigest(name.encode())}"
    digest = xxhash.xxh3_128()
    names = sorted(
        path
        for path in folder.iterdir()
        if path.name == "config.json" or path.name.endswith(WEIGHT_SUFFIXES)
    )
    for path in names:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return f"xxh3:{digest.hexdigest()}"
