"""The bus's and the archive's tests run on the machine's Redis and on an embedded Valkey: stream commands
(XAUTOCLAIM, XINFO, XTRIM MINID, transactions) are where the two servers could differ."""

from __future__ import annotations

import pytest

SERVER_URL_FIXTURES = {"redis": "machine_redis_url", "valkey": "valkey_url", "cluster": "redis_cluster_url"}


@pytest.fixture(params=["redis", "valkey"])
def redis_url(request):
    """The URL of a Redis 7.0 and of a Valkey; of a Redis Cluster too in a module that parametrizes it with
    `cluster` (the bus fixture then makes a cluster client)."""
    return request.getfixturevalue(SERVER_URL_FIXTURES[request.param])
