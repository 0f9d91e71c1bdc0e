"""Redis clients for services, which ride out a Redis restart or failover.

Every command of a service's client (`connect_redis`, or `connect_async_redis` for one that serves from an
event loop) is retried on a lost connection with capped exponential back-off, for as long as it takes, and the
outage is logged; a refused login is not retried, since waiting never mends a wrong password. A client for
commands a person waits on (`rollstream inspect`) fails at once instead. Works on Redis 7.0, on Valkey, and on
a Redis Cluster.

    python -m pytest tests/unit/shared/contract/test_reconnect.py \
        tests/unit/shared/contract/test_async_redis.py -q
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError
from redis.retry import Retry

log = logging.getLogger(__name__)

RECONNECT_BASE_S = 0.1
RECONNECT_CAP_S = 5.0
"""Back-off between reconnection attempts: doubling from the base, never longer than the cap."""
ASYNC_MAX_CONNECTIONS = 64
"""Connections of one asyncio client; a command waits for a free one."""
_OUTAGE_ERRORS = [redis.ConnectionError, redis.TimeoutError, BusyLoadingError]


def connect_redis(url: str, *, ride_out_outages: bool = True, cluster: bool = False) -> redis.Redis:
    """A client for a service: every command is retried on a lost connection (ConnectionError,
    TimeoutError, and LOADING while a restarted Redis reads its append-only file) until Redis answers
    again. ride_out_outages=False: fail at once (commands a person waits on, such as `inspect`).
    cluster: `url` is a node of a Redis Cluster (a RedisCluster client, which retries on the cluster's own
    terms: a moved slot, a failed-over node)."""
    if cluster:
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(url, socket_connect_timeout=5, socket_keepalive=True)
    if not ride_out_outages:
        return redis.Redis.from_url(url, socket_connect_timeout=5)
    retry = _OutageRetry(_LoggedBackoff(cap=RECONNECT_CAP_S, base=RECONNECT_BASE_S), retries=-1)
    return redis.Redis.from_url(url, retry=retry, socket_connect_timeout=5, socket_keepalive=True,
                                retry_on_error=_OUTAGE_ERRORS)


def connect_async_redis(url: str, *, ride_out_outages: bool = True,
                        cluster: bool = False) -> redis.asyncio.Redis:
    """connect_redis's client for asyncio: its commands run on the event loop that first uses it (one loop
    per client), and wait out an outage the same way without holding the loop. At most
    ASYNC_MAX_CONNECTIONS connections: a command waits for a free one (the default pool refuses the 101st
    command at once, which 256 gateway sessions reached)."""
    if cluster:
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(url, socket_connect_timeout=5, socket_keepalive=True)
    options = {"max_connections": ASYNC_MAX_CONNECTIONS, "timeout": None, "socket_connect_timeout": 5}
    if ride_out_outages:
        retry = _AsyncOutageRetry(_LoggedBackoff(cap=RECONNECT_CAP_S, base=RECONNECT_BASE_S), retries=-1)
        options.update(retry=retry, retry_on_error=_OUTAGE_ERRORS, socket_keepalive=True)
    return redis.asyncio.Redis.from_pool(redis.asyncio.BlockingConnectionPool.from_url(url, **options))


def with_credentials_of(source: str, target: str) -> str:
    """URL `target` with the user and password of URL `source` (a Redis of the run's job queues is reached as
    the bus's user)."""
    userinfo = urlsplit(source).netloc.rpartition("@")[0]
    parts = urlsplit(target)
    return urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.netloc}")) if userinfo else target


class _LoggedBackoff(ExponentialWithJitterBackoff):
    """The back-off of a lost connection, which says so in the log: at the first failed attempt, then
    at every power of two, so that a long outage is visible without a line per attempt."""

    def compute(self, failures: int) -> float:
        if failures & (failures - 1) == 0:
            log.warning("Redis unreachable; retrying with back-off", extra={"attempts": failures})
        return super().compute(failures)


def _unless_refused(is_retryable: Callable[[Exception], bool] | None) -> Callable[[Exception], bool]:
    """Retry lost connections, but not a refused login: AuthenticationError is a ConnectionError to redis-py,
    and a wrong password never gets better by waiting."""

    def retryable(error: Exception) -> bool:
        if isinstance(error, AuthenticationError):
            return False
        return is_retryable(error) if is_retryable is not None else True

    return retryable


class _OutageRetry(Retry):
    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        return super().call_with_retry(do, fail, _unless_refused(is_retryable), with_failure_count)


class _AsyncOutageRetry(AsyncRetry):
    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        return await super().call_with_retry(do, fail, _unless_refused(is_retryable), with_failure_count)
