"""disagg_request_id: TensorRT-LLM's snowflake layout, unique per worker and increasing."""

from __future__ import annotations

import pytest

from shmdisagg.orchestrator.ids import DisaggIdGenerator


def test_ids_are_positive_int64_above_worker_local_range_and_increasing() -> None:
    gen = DisaggIdGenerator(node_id=7, process_id=3)
    ids = [gen.next_id() for _ in range(5000)]  # > 1024 per ms forces the counter to wrap
    assert all(2**40 <= i < 2**63 - 1 for i in ids)
    assert all(a < b for a, b in zip(ids, ids[1:], strict=False))


def test_workers_never_mint_the_same_id() -> None:
    gens = [DisaggIdGenerator(node_id=1, process_id=p) for p in range(4)]
    ids = [g.next_id() for _ in range(2000) for g in gens]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(("node", "proc"), [(256, 0), (-1, 0), (0, 64)])
def test_out_of_range_fields_are_refused(node: int, proc: int) -> None:
    with pytest.raises(ValueError):
        DisaggIdGenerator(node, proc)
