"""Fixtures of the hashing tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shmdisagg import _native


@pytest.fixture(params=["avx2", "portable"])
def v1_impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test with the AVX2 v1 code (the one-loop path and the prefix cache's vector
    fingerprints, where the CPU has AVX2) and with the portable code."""
    impl = _native._v1_impl(request.param == "portable")
    yield impl
    _native._v1_impl(False)
