"""The bus's and the archive's tests run on the machine's Redis and on an embedded Valkey: stream commands
(XAUTOCLAIM, XINFO, XTRIM MINID, transactions) are where the two servers could differ."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["redis", "valkey"])
def redis_url(request):
    return request.getfixturevalue("machine_redis_url" if request.param == "redis" else "valkey_url")
