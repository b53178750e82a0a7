"""The delivery modes by name: the one module of the producer that knows both.

The vLLM adapter (``connector``) hands each side the maker of its mode, chosen once from
the options' ``delivery``. The shared sides (``worker_side``, ``scheduler_side``) then
know a mode only by its protocols (``mode``)."""

from __future__ import annotations

from kv_connector.producer.delivery import DeliveryBook
from kv_connector.producer.mode import RankCache, SchedulerMode, WorkerMode
from kv_connector.producer.options import ConnectorOptions, Delivery
from kv_connector.producer.pull.mode import PullScheduling, PullWorker
from kv_connector.producer.push.mode import PushScheduling, PushWorker


def worker_mode(options: ConnectorOptions, rc: RankCache) -> WorkerMode:
    """This rank's delivery, serving from its registered cache."""
    if options.delivery is Delivery.PULL:
        return PullWorker(options, rc)
    return PushWorker(options, rc)


def scheduler_mode(
    options: ConnectorOptions, book: DeliveryBook, producer_id: str, world_size: int
) -> SchedulerMode:
    """The scheduler side's part of the delivery."""
    if options.delivery is Delivery.PULL:
        return PullScheduling(options, book, producer_id, world_size)
    return PushScheduling(options, book, producer_id, world_size)
