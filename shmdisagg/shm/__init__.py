"""Shared-memory routing state: segment lifecycle (`segment`), layout names (`layout`), the
control table (`table`) and the KV block index (`index`). See native/README.md for the layouts
and the concurrency model."""

from shmdisagg.shm.index import BlockIndex, IndexSettings, IndexStats, pack_hashes
from shmdisagg.shm.layout import ROLE_CONTEXT, ROLE_GENERATION
from shmdisagg.shm.segment import (
    DeploymentRunning,
    LayoutMismatch,
    RetryExhausted,
    RowLost,
    Segment,
    SegmentFull,
    SegmentNotReady,
    ShmError,
    cleanup_stale,
    segment_names,
)
from shmdisagg.shm.table import ControlTable, RowInfo, ServerInfo, process_starttime

__all__ = [
    "ROLE_CONTEXT",
    "ROLE_GENERATION",
    "BlockIndex",
    "ControlTable",
    "DeploymentRunning",
    "IndexSettings",
    "IndexStats",
    "LayoutMismatch",
    "RetryExhausted",
    "RowInfo",
    "RowLost",
    "Segment",
    "SegmentFull",
    "SegmentNotReady",
    "ServerInfo",
    "ShmError",
    "cleanup_stale",
    "pack_hashes",
    "process_starttime",
    "segment_names",
]
