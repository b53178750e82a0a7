"""Scheduler side of the connector: turns each step's SchedulerOutput into a ship plan and
holds finished requests' blocks until every worker reported them sent."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kv_connector.options import ConnectorOptions
from kv_connector.planning import NewRequest, Router, RunningRequest, ShipPlanner, StepPlan

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def hidden_state_group(kv_cache_config: KVCacheConfig | None, layer_marker: str = "cache_only_layers") -> int:
    """Index of the KV cache group whose block table addresses the hidden states.

    The group that holds the cache-only layer (vLLM's own grouping), found by its spec or
    layer name; on hybrid models with the supplementary-tensor design, the full-attention
    group named by ``kv_cache_config.supplementary_group`` (see ``hybrid``).
    """
    if kv_cache_config is None:
        return 0
    supp = getattr(kv_cache_config, "supplementary_group", None)
    if supp is not None:
        return int(supp)
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    found = [
        i
        for i, g in enumerate(groups)
        if isinstance(g.kv_cache_spec, HiddenStateCacheSpec) or any(layer_marker in n for n in g.layer_names)
    ]
    if len(found) == 1:
        return found[0]
    if not found and len(groups) == 1:
        return 0
    raise ValueError(
        f"cannot find the one KV cache group of the hidden states among {len(groups)} groups "
        f"(candidates {found}); is vLLM running the extract_hidden_states method?"
    )


class SchedulerSide:
    def __init__(
        self, options: ConnectorOptions, kv_cache_config: KVCacheConfig | None, producer_id: str
    ) -> None:
        self.options = options
        self.group = hidden_state_group(kv_cache_config)
        self.producer_id = producer_id
        self.planner = ShipPlanner(Router(len(options.readers), options.sharding))

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params or {}
        include = bool(params.get("include_output_tokens", self.options.include_output_tokens))
        self.planner.add(request.request_id, include_output=include)

    def build_plan(self, out: SchedulerOutput) -> StepPlan:
        g = self.group
        new = [
            NewRequest(
                r.req_id,
                r.prompt_token_ids or [],
                r.block_ids[g] if r.block_ids else [],
                r.num_computed_tokens,
            )
            for r in out.scheduled_new_reqs
        ]
        c = out.scheduled_cached_reqs
        running = [
            RunningRequest(
                rid,
                (c.new_block_ids[i] or ())[g] if c.new_block_ids[i] else None,
                rid in c.resumed_req_ids,
                c.num_computed_tokens[i],
            )
            for i, rid in enumerate(c.req_ids)
        ]
        return self.planner.plan(new, running, out.num_scheduled_tokens, out.preempted_req_ids or ())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        hold = self.planner.finish(rid, list(request.all_token_ids), block_ids)
        if not hold:
            self.planner.forget_route(rid)
            return False, None
        reader = self.planner.reader_of(rid)
        if not self.planner.is_pending(rid):
            self.planner.forget_route(rid)
        return True, {
            "hidden_states": {
                "consumer_address": self.options.readers[reader],
                "producer_id": self.producer_id,
                "request_id": request.request_id,
            }
        }
