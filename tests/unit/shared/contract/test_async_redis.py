"""connect_async_redis (redis_clients.py): a service's asyncio client, on the machine's Redis. More commands
at once than it has connections wait for a free one rather than fail (a gateway serving hundreds of sessions
sends that many).

    python -m pytest tests/unit/shared/contract/test_async_redis.py -q
"""

from __future__ import annotations

import asyncio
import uuid

from rollstream.shared.contract.redis_clients import ASYNC_MAX_CONNECTIONS, connect_async_redis


def test_more_commands_at_once_than_connections_wait_for_one(machine_redis_url):
    async def scenario() -> list:
        client = connect_async_redis(machine_redis_url)
        try:
            # each holds its connection for its whole timeout: the key is never pushed to
            empty = f"rs-test:{uuid.uuid4().hex}"
            return await asyncio.gather(*(client.blpop([empty], timeout=0.1)
                                          for _ in range(4 * ASYNC_MAX_CONNECTIONS)))
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == [None] * (4 * ASYNC_MAX_CONNECTIONS)
