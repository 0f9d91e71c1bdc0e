"""The one active instance of a service in a run (the dispatcher, the trainer): a second one started for the
same run stands by until the first's lease ends, instead of admitting or training twice.

The lease is a Redis key (Keys.lock) holding the holder's random token, set with NX and an expiry and renewed
every third of it; a holder killed without a goodbye frees it when the lease expires. A holder cut off from
Redis for longer than its lease takes the lock again if nobody did meanwhile, and otherwise has lost it
(LockLost): another instance is active, and this one must stop.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import redis

from rollstream.shared.contract.bus import Bus
from rollstream.shared.errors import RollstreamError


class LockLost(RollstreamError, RuntimeError):
    """Another instance of the service holds the run's lock now."""


class RunLock:
    def __init__(self, bus: Bus, name: str, ttl_ms: int) -> None:
        self.redis = bus.redis
        self.key = bus.keys.lock(name)
        self.ttl_ms = ttl_ms
        self.token = uuid.uuid4().hex
        self.renewed = 0.0
        self.lost: LockLost | None = None
        """Set by keep_renewed's thread when another instance took the lock."""
        self._released = threading.Event()

    def acquire(self, stopping: Callable[[], bool], on_standby: Callable[[], None]) -> bool:
        """Wait until this instance holds the lock (True), calling on_standby each second it waits; False when
        stopping() says to stop first."""
        while not stopping():
            if self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms):
                self.renewed = time.monotonic()
                return True
            on_standby()
            time.sleep(1)
        return False

    def renew(self) -> None:
        """Extend the lease; LockLost when another instance holds the lock."""
        holder = self.redis.get(self.key)
        if holder is None and self.redis.set(self.key, self.token, nx=True, px=self.ttl_ms):
            holder = self.token.encode()
        if holder != self.token.encode():
            raise LockLost(f"another instance holds the run's lock {self.key}")
        self.redis.pexpire(self.key, self.ttl_ms)
        self.renewed = time.monotonic()

    def renew_when_due(self) -> None:
        """Renew once a third of the lease has passed since the last renewal: for a holder's own loop."""
        if time.monotonic() - self.renewed > self.ttl_ms / 3000:
            self.renew()

    def keep_renewed(self) -> threading.Thread:
        """Renew from a daemon thread until release(), for a holder whose work outlasts the lease (a training
        step); when another instance takes the lock, the thread sets `lost` and ends. A Redis outage is
        retried until the lease ends."""
        def renew_until_released() -> None:
            while not self._released.wait(self.ttl_ms / 3000):
                try:
                    self.renew()
                except LockLost as lost:
                    self.lost = lost
                    return
                except redis.RedisError:
                    continue

        thread = threading.Thread(target=renew_until_released, name=f"renew {self.key}", daemon=True)
        thread.start()
        return thread

    def release(self) -> None:
        """Give the lock up (a renewing thread stops first, so that it cannot take the lock again)."""
        self._released.set()
        if self.redis.get(self.key) == self.token.encode():
            self.redis.delete(self.key)
