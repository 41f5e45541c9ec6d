"""TierKVConnector: vLLM's v1 KV-connector API (KVConnectorBase_V1) over tierkv's L2 and L3.

vLLM builds one in its scheduler process (role SCHEDULER) and one in each worker (role WORKER);
each call goes to that role's half: scheduler_side.py decides, worker_side.py copies. This file
only maps vLLM's method names and arguments onto them. It supports vLLM's hybrid KV-cache manager
(SupportsHMA): each KV-cache group gets a cache of its own (options.per_group).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from . import options
from .records import CopiesDone, StepWork
from .stats import TierKVPromMetrics, TierKVStats

log = logging.getLogger(__name__)


class TierKVConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.scheduler = self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler_side import SchedulerSide

            # A corrupt or missing L3 object must make vLLM recompute, never fail the request:
            # vLLM's default policy ("fail") ends it with an error. The scheduler reads the policy
            # after it builds the connector, from this same config object.
            transfer = self._kv_transfer_config
            if transfer.kv_load_failure_policy != "recompute":
                log.info("TierKVConnector sets kv_load_failure_policy=recompute (was %s): a block tierkv cannot "
                         "load is recomputed", transfer.kv_load_failure_policy)
                transfer.kv_load_failure_policy = "recompute"
            events = vllm_config.kv_events_config
            groups = options.per_group(options.parse(vllm_config, kv_cache_config.num_blocks), kv_cache_config)
            self.scheduler = SchedulerSide(groups, events=events is not None and events.enable_kv_cache_events)
        else:
            from .worker_side import WorkerSide

            self.worker = WorkerSide(options.per_group(options.parse(vllm_config), kv_cache_config))

    # ------------------------------------------------------------------ scheduler role

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.allocated(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> StepWork:
        return self.scheduler.step(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.copies_done(connector_output.kv_connector_worker_meta)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self.scheduler.finished(request)
        return False, None  # its copies ran within the steps that recorded them

    def request_finished_all_groups(self, request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self.request_finished(request, [])  # (vLLM's hybrid manager calls this one)

    def reset_cache(self) -> bool:
        return self.scheduler.reset()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: nothing downstream waits for what it stores

    def take_events(self) -> Iterable:
        return self.scheduler.take_events()

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        from_l2, from_l3 = self.scheduler.hit_sources(request, num_external_tokens)
        l3 = CacheHitSource.DISK if self.scheduler.l3_is_local_disk else CacheHitSource.EXTERNAL_UNSPECIFIED
        return {k: v for k, v in ((CacheHitSource.HOST, from_l2), (l3, from_l3)) if v}

    def get_kv_connector_stats(self):
        return self.scheduler.take_stats() if self.scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None):
        return TierKVStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return TierKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ worker role

    def register_kv_caches(self, kv_caches) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.worker.register(kv_caches, get_tensor_model_parallel_rank())

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.worker.load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        pass  # whole blocks are saved after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        self.worker.save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        work = self._connector_metadata
        done = set(work.loaded_async) if isinstance(work, StepWork) else set()
        return None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # with several KV-cache groups a failed load is a whole request (vLLM recomputes it)
        _, done = self.get_finished(finished_req_ids)
        work = self._connector_metadata
        failed = set(work.failed_async) if isinstance(work, StepWork) else set()
        return KVConnectorTransferResults(finished_recving=set(done or ()), failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        work = self._connector_metadata
        return set(work.load_errors) if isinstance(work, StepWork) else set()

    def build_connector_worker_meta(self) -> CopiesDone:
        return self.worker.report()

    # ------------------------------------------------------------------ both

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict) -> bool:
        return True  # each layer waits for its loads in wait_for_layer_load, which a full graph skips

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        # heads outer: each (layer, block) page is one run of bytes (CPU attention takes only this)
        return "HND"

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        if self.worker is not None:
            self.worker.close()
