"""Model Runner V2 (``vllm/v1/worker/gpu/``, what GPU users run) with the plugin, on
vLLM's own V2 code run on CPU (0.32, and 0.33 under ``make test-vllm033``): V2's
``init_kv_cache`` allocates the supplementary tensor and binds it to vLLM's real
cache-only layer, V2's ``ExtractHiddenStatesSpeculator.propose`` writes the hidden
states through it with the attention group's slot mapping, and the engine core's calls
(0.33: grouping, then sizing with the groups) plan it. No model runs: the drafter's
model is vLLM's cache-only layer alone, the step's inputs are built by hand."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hybrid import plugin
from hybrid.shapes import HybridShape
from scripts.support.make_tiny_model import TINY_QWEN3_NEXT

pytestmark = pytest.mark.slow

NAME = "cache_only_layers.8"
LAYERS = (1, 4, 8)
HIDDEN = 128


@pytest.fixture(scope="module")
def tiny() -> Iterator[tuple[Any, Any, dict[str, Any]]]:
    """The e2e test's tiny Qwen3-Next: vLLM's config (its static forward context holds
    vLLM's real cache-only layer), the design's KV cache config at 32 MiB, the specs."""
    from hybrid.accounting import Setup, engine_config, layer_specs
    from hybrid.spec import plan_kv_cache_configs

    shape = HybridShape.from_config(
        {**TINY_QWEN3_NEXT, "architectures": ["Qwen3NextForCausalLM"], "torch_dtype": "bfloat16"}
    )
    setup = Setup(
        layer_ids=LAYERS, budget_bytes=32 << 20, max_model_len=2048, platform="cpu", prefix_caching=False
    )
    with engine_config(shape, setup) as cfg:
        specs = layer_specs(cfg, shape, "cpu")
        (config,) = plan_kv_cache_configs(cfg, [dict(specs)], [setup.budget_bytes])
        yield cfg, config, specs


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(plugin.ENV, raising=False)
    plugin.register()
    yield
    plugin.unregister()


class Binder:
    """A target layer's stand-in for binding only: what ``bind_kv_cache`` was given."""

    def __init__(self) -> None:
        self.kv_cache: torch.Tensor | None = None

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache


def v2_init_kv_cache(cfg: Any, config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """V2's ``init_kv_cache`` as its runner calls it (one kernel block per manager
    block), the cache-only layer vLLM's own, the target's layers stand-ins."""
    from vllm.v1.worker.gpu.attn_utils import init_kv_cache

    layer = cfg.compilation_config.static_forward_context[NAME]
    layer.kv_cache = torch.tensor([])
    forward_context: dict[str, Any] = {n: Binder() for g in config.kv_cache_groups for n in g.layer_names}
    forward_context[NAME] = layer
    sizes = [g.kv_cache_spec.block_size for g in config.kv_cache_groups]
    caches = init_kv_cache(forward_context, config, torch.device("cpu"), sizes, cfg)
    return caches, forward_context


def test_v2_init_kv_cache_allocates_and_binds_the_supplementary_tensor(
    tiny: tuple[Any, Any, dict[str, Any]], installed: None
) -> None:
    cfg, config, _ = tiny
    caches, forward_context = v2_init_kv_cache(cfg, config)
    hs = caches[NAME]
    bs = config.kv_cache_groups[config.supplementary_group].kv_cache_spec.block_size
    assert tuple(hs.shape) == (config.num_blocks, len(LAYERS), bs, HIDDEN) and hs.dtype == torch.bfloat16
    assert forward_context[NAME].kv_cache is hs  # bound to vLLM's layer, handed to the connector
    assert all(forward_context[n].kv_cache is caches[n] for n in caches if n != NAME)


def test_v2_without_the_plugin_has_no_supplementary_tensor(tiny: tuple[Any, Any, dict[str, Any]]) -> None:
    plugin.unregister()
    cfg, config, _ = tiny
    caches, _ = v2_init_kv_cache(cfg, config)
    assert NAME not in caches  # what a GPU user got before: "found 0 cache-only layers"


def test_v2_drafter_writes_with_the_attention_groups_slots(
    tiny: tuple[Any, Any, dict[str, Any]], installed: None
) -> None:
    from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer
    from vllm.v1.worker.gpu.spec_decode.extract_hidden_states import ExtractHiddenStatesSpeculator

    cfg, config, _ = tiny
    caches, forward_context = v2_init_kv_cache(cfg, config)
    hs = caches[NAME]
    att = config.supplementary_group
    bs = config.kv_cache_groups[att].kv_cache_spec.block_size
    # one step of 3 tokens: the attention group puts them in blocks 2, 2 and 7; the
    # state groups' slot mappings are elsewhere (they must not be used)
    slots = torch.full((len(config.kv_cache_groups), 3), -1, dtype=torch.int64)
    slots[att] = torch.tensor([2 * bs + 5, 2 * bs + 6, 7 * bs + bs - 1])
    slot_mappings = build_slot_mappings_by_layer(slots, config)  # V2's own, per group
    assert NAME not in slot_mappings
    attn_metadata: dict[str, Any] = {n: object() for n in slot_mappings}
    drafter: Any = object.__new__(ExtractHiddenStatesSpeculator)  # its state, without a model load
    drafter.vllm_config = cfg
    drafter.num_hidden_states = len(LAYERS)
    drafter.hidden_states = torch.zeros(8, len(LAYERS), HIDDEN, dtype=torch.bfloat16)
    drafter.draft_attn_layer_names = {NAME}
    drafter.kv_cache_config = config  # set_attn's copy of the runner's config
    layer = forward_context[NAME]
    drafter.model = lambda hidden_states: layer(hidden_states)  # vLLM's cache-only layer
    aux = [torch.randn(3, HIDDEN).to(torch.bfloat16) for _ in LAYERS]
    batch = SimpleNamespace(idx_mapping=torch.arange(2), is_padding=torch.zeros(3, dtype=torch.bool))
    drafter.propose(
        batch,
        attn_metadata,
        slot_mappings,
        None,
        aux,
        torch.ones(2, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(2, 1, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int64),
        torch.ones(2),
        torch.zeros(2, dtype=torch.int64),
    )
    states = torch.stack(aux, dim=1)
    assert torch.equal(hs[2, :, 5], states[0]) and torch.equal(hs[2, :, 6], states[1])
    assert torch.equal(hs[7, :, bs - 1], states[2])
    assert int((hs != 0).sum()) == int((states != 0).sum())  # and nothing else
    assert slot_mappings[NAME] is slot_mappings[config.kv_cache_groups[att].layer_names[0]]
    assert attn_metadata[NAME].slot_mapping is slot_mappings[NAME]


def test_engine_core_plans_through_the_plugin(tiny: tuple[Any, Any, dict[str, Any]], installed: None) -> None:
    """The engine core's own sequence, by the names it looks up: 0.33 groups first
    (``get_global_kv_cache_groups``) and sizes with the groups; 0.32 sizes alone."""
    import vllm.v1.engine.core as core

    from hybrid.spec import SupplementedKVCacheConfig
    from hybrid.versions import groups_before_configs

    cfg, planned, specs = tiny
    budget = [32 << 20]
    if groups_before_configs():
        groups = core.get_global_kv_cache_groups(cfg, [dict(specs)])
        assert NAME not in {n for g in groups for n in g.layer_names}
        (config,) = core.get_kv_cache_configs(cfg, [dict(specs)], budget, groups)
        # vLLM's own groups (the layer in one of them), as an unpatched grouping gives them
        theirs = vars(core)["get_global_kv_cache_groups"].__hybrid_original__(cfg, [dict(specs)])
        assert NAME in {n for g in theirs for n in g.layer_names}
        (again,) = core.get_kv_cache_configs(cfg, [dict(specs)], budget, theirs)
        assert again.num_blocks == planned.num_blocks and set(again.supplementary_specs) == {NAME}
    else:
        (config,) = core.get_kv_cache_configs(cfg, [dict(specs)], budget)
    assert isinstance(config, SupplementedKVCacheConfig) and set(config.supplementary_specs) == {NAME}
    assert config.num_blocks == planned.num_blocks and config.supplementary_group == 3


def test_runner_v2_without_its_patch_points_fails_at_start_with_the_fix(
    tiny: tuple[Any, Any, dict[str, Any]], installed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.v1.engine.core as core
    from vllm.config import VllmConfig

    from hybrid import versions

    cfg, _, specs = tiny
    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(lambda self: True))
    extra = [core.get_global_kv_cache_groups(cfg, [dict(specs)])] if versions.groups_before_configs() else []
    core.get_kv_cache_configs(cfg, [dict(specs)], [32 << 20], *extra)  # V2 patched: fine
    monkeypatch.setattr(plugin, "v2_installed", lambda: False)
    with pytest.raises(plugin.UnsupportedVLLMError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        core.get_kv_cache_configs(cfg, [dict(specs)], [32 << 20], *extra)


@pytest.fixture
def connector_logging() -> Iterator[None]:
    """The connector sends its log through vLLM's handlers (``use_vllm_logging``): undone
    after the test, for the tests that read ``kv_connector``'s log."""
    ours = logging.getLogger("kv_connector")
    handlers, level, propagate = list(ours.handlers), ours.level, ours.propagate
    yield
    ours.handlers[:] = handlers
    ours.propagate = propagate
    ours.setLevel(level)


def test_real_scheduler_with_our_connector_ships_the_attention_groups_blocks(
    tiny: tuple[Any, Any, dict[str, Any]],
    installed: None,
    connector_logging: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's own Scheduler, built the way its engine core builds it from the design's
    config, with our connector's scheduler side: a request's blocks come from the
    attention group's block table (the hidden states have no group), the ship plan
    names those blocks, and V2's drafter writes the request's states into them."""
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer
    from vllm.v1.worker.gpu.spec_decode.extract_hidden_states import ExtractHiddenStatesSpeculator

    from kv_connector.connector import HiddenStatesConnectorMetadata, HiddenStatesWorkerMetadata
    from kv_connector.producer.worker_report import WorkerReport

    cfg, config, _ = tiny
    ktc = KVTransferConfig(
        kv_connector="HiddenStatesConnector",
        kv_connector_module_path="kv_connector.connector",
        kv_role="kv_producer",
        kv_connector_extra_config={"consumer_address": "127.0.0.1:9"},
    )
    monkeypatch.setattr(cfg, "kv_transfer_config", ktc)
    sched_config = generate_scheduler_kv_cache_config([config])
    monkeypatch.setattr(cfg.cache_config, "num_gpu_blocks", sched_config.num_blocks)
    block_size, hash_block_size = resolve_kv_cache_block_sizes(sched_config, cfg)
    scheduler = Scheduler(
        vllm_config=cfg,
        kv_cache_config=sched_config,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )
    att = config.supplementary_group
    bs = config.kv_cache_groups[att].kv_cache_spec.block_size
    assert len(scheduler.kv_cache_manager.coordinator.single_type_managers) == len(config.kv_cache_groups)
    connector: Any = scheduler.connector
    # the worker's report that it reaches the reader: requests are admitted
    reaches = HiddenStatesWorkerMetadata(report=WorkerReport(links=[("127.0.0.1:9", 0, None)]))
    connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=reaches))
    tokens = list(range(1, bs + 6))  # one block and 5 tokens
    params = SamplingParams(max_tokens=2)
    params.update_from_generation_config({}, 0)
    scheduler.add_request(
        Request(request_id="r0", prompt_token_ids=tokens, sampling_params=params, pooling_params=None)
    )
    out = scheduler.schedule()
    (new,) = out.scheduled_new_reqs
    blocks = list(new.block_ids[att])
    assert len(blocks) == 2 and all(0 < b < config.num_blocks for b in blocks)
    meta = out.kv_connector_metadata
    assert isinstance(meta, HiddenStatesConnectorMetadata)
    (piece,) = meta.plan.slices
    assert piece.request_id == "r0" and list(piece.block_ids) == blocks
    # the step as V2 runs it: the attention group's slots, the drafter writing through them
    caches, forward_context = v2_init_kv_cache(cfg, config)
    hs = caches[NAME]
    positions = torch.arange(len(tokens))
    slots = torch.full((len(config.kv_cache_groups), len(tokens)), -1, dtype=torch.int64)
    slots[att] = torch.tensor(blocks)[positions // bs] * bs + positions % bs
    drafter: Any = object.__new__(ExtractHiddenStatesSpeculator)
    drafter.vllm_config = cfg
    drafter.num_hidden_states = len(LAYERS)
    drafter.hidden_states = torch.zeros(len(tokens), len(LAYERS), HIDDEN, dtype=torch.bfloat16)
    drafter.draft_attn_layer_names = {NAME}
    drafter.kv_cache_config = config
    layer = forward_context[NAME]
    drafter.model = lambda hidden_states: layer(hidden_states)
    aux = [torch.randn(len(tokens), HIDDEN).to(torch.bfloat16) for _ in LAYERS]
    drafter.propose(
        SimpleNamespace(idx_mapping=torch.arange(1), is_padding=torch.zeros(len(tokens), dtype=torch.bool)),
        {},
        build_slot_mappings_by_layer(slots, config),
        None,
        aux,
        *[torch.zeros(1, dtype=torch.int64)] * 2,
        torch.zeros(1, 1, dtype=torch.int64),
        *[torch.zeros(1)] * 3,
    )
    states = torch.stack(aux, dim=1)
    # what the connector reads for the request: its blocks, positions 0.. in order
    read = torch.cat([hs[b] for b in blocks], dim=1).transpose(0, 1)[: len(tokens)]
    assert torch.equal(read, states)
