"""Shared-memory routing state: segment lifecycle (`segment`), layout names (`layout`) and the
control table (`table`). See native/README.md for the layout and the concurrency model."""

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
    "ControlTable",
    "DeploymentRunning",
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
    "process_starttime",
    "segment_names",
]
