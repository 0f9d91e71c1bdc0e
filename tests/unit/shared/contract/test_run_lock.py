"""One active instance of a service per run (shared/contract/run_lock.py), on a real Redis."""

from __future__ import annotations

import threading
import time

import pytest

from rollstream.shared.contract.run_lock import LockLost, RunLock

TTL_MS = 600


def test_a_second_instance_stands_by_until_the_first_releases(bus):
    first, second = RunLock(bus, "trainer", TTL_MS), RunLock(bus, "trainer", TTL_MS)
    assert first.acquire(lambda: False, lambda: None)
    standby, held = [], threading.Event()
    def wait_for_the_lock():
        if second.acquire(lambda: False, lambda: standby.append(1)):
            held.set()

    waiter = threading.Thread(target=wait_for_the_lock)
    waiter.start()
    for _ in range(3):  # past the lease: the first keeps it by renewing
        time.sleep(TTL_MS / 3000)
        first.renew()
    assert not held.is_set() and standby
    first.release()
    assert held.wait(5)
    waiter.join()


def test_a_holder_killed_without_a_goodbye_frees_the_lock_when_its_lease_ends(bus):
    RunLock(bus, "trainer", TTL_MS).acquire(lambda: False, lambda: None)  # never renewed, never released
    started = time.monotonic()
    assert RunLock(bus, "trainer", TTL_MS).acquire(lambda: False, lambda: None)
    assert time.monotonic() - started >= TTL_MS / 1000 * 0.5


def test_a_holder_whose_lease_lapsed_to_another_has_lost_the_lock(bus):
    first, second = RunLock(bus, "dispatcher", TTL_MS), RunLock(bus, "dispatcher", TTL_MS)
    first.acquire(lambda: False, lambda: None)
    bus.redis.delete(first.key)  # the lease ran out during an outage
    assert second.acquire(lambda: False, lambda: None)
    with pytest.raises(LockLost, match="another instance holds"):
        first.renew()
    first.release()  # not the holder's: leaves the lock to it
    second.renew()


def test_a_holder_whose_lease_lapsed_with_nobody_waiting_takes_it_again(bus):
    lock = RunLock(bus, "dispatcher", TTL_MS)
    lock.acquire(lambda: False, lambda: None)
    bus.redis.delete(lock.key)
    lock.renew()
    assert bus.redis.get(lock.key) == lock.token.encode()


def test_keep_renewed_holds_the_lock_past_its_lease_and_says_when_it_is_lost(bus):
    lock = RunLock(bus, "trainer", TTL_MS)
    lock.acquire(lambda: False, lambda: None)
    lock.keep_renewed()
    stop_at = time.monotonic() + 3 * TTL_MS / 1000
    assert not RunLock(bus, "trainer", TTL_MS).acquire(lambda: time.monotonic() > stop_at, lambda: None)
    bus.redis.set(lock.key, "someone else")
    deadline = time.monotonic() + 5
    while lock.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert isinstance(lock.lost, LockLost)


def test_a_released_lock_is_not_taken_again_by_its_renewing_thread(bus):
    lock = RunLock(bus, "trainer", TTL_MS)
    lock.acquire(lambda: False, lambda: None)
    renewing = lock.keep_renewed()
    lock.release()
    renewing.join(timeout=5)
    assert not renewing.is_alive()
    assert bus.redis.get(lock.key) is None
