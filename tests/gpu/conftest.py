"""The Buffers a GPU test module shares through tests/helpers/low_latency.POOL are destroyed at
that module's end (collective: every rank reaches it)."""
import pytest

from tests.helpers.low_latency import POOL


@pytest.fixture(scope="module", autouse=True)
def _destroy_shared_low_latency_buffers():
    yield
    POOL.destroy_all()
