"""Round trips to Redis from asyncio, for a hot path: a list of commands written at once, their replies read
back in order, as one pipeline.

redis-py's asyncio client spends about 150 µs of CPU on a pipelined round trip of three small commands:
its pool's lock and timeout around every checkout, a task per write for the socket timeout, packing in
Python, response callbacks and observability hooks on every command. `HiredisRoundTrips` spends about 63 µs
on the same round trip, of which the same bytes written and read bare on an asyncio stream take about 40
(mostly the socket's own work); the gateway makes two such round trips a turn. It packs and parses with
hiredis (redis-py's own parser) and keeps its connections open between round trips; it serves a plain
`redis://` URL, with its password, ACL user and database. Anything else (a Redis Cluster, TLS, a Unix
socket) goes through redis-py's pipeline (`PipelineRoundTrips`), which knows them.

Both ride out an outage as connect_async_redis's client does: they take that client's retry (back-off, the
errors it retries, a refused login never retried), and a round trip that lost its connection is written
again on a new one. Commands are named as redis-py names them (`("SCRIPT LOAD", source)`, which a cluster
routes to every primary). Replies are as redis-py gives them without decoding: bytes, ints, lists, None;
HGETALL a dict; an error reply is its redis-py exception in the list (NoScriptError, ResponseError, ...).

    python -m pytest tests/unit/shared/contract/test_redis_round_trips.py -q
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

import hiredis
import redis
import redis.asyncio
from redis._parsers.base import BaseParser
from redis.exceptions import BusyLoadingError

from rollstream.shared.contract.bus import connect_async_redis

Command = Sequence[str | bytes | int | float]
ROUND_TRIP_TIMEOUT_S = 5.0
"""How long a round trip may take before its connection counts as lost (redis-py's socket timeout): no
blocking command that waits longer goes through HiredisRoundTrips."""
READ_SIZE = 65536


def _pairs(reply: list) -> dict:
    return dict(zip(reply[::2], reply[1::2]))


_SHAPES = {"HGETALL": _pairs, "SCRIPT LOAD": bytes.decode}
"""Replies that redis-py reshapes, reshaped the same way."""


def _packed(command: Command) -> bytes:
    name = command[0]
    if isinstance(name, str) and " " in name:  # "SCRIPT LOAD", as redis-py names it: two words to Redis
        command = (*name.split(), *command[1:])
    return hiredis.pack_command(tuple(command))


class RoundTrips(Protocol):
    async def run(self, *commands: Command) -> list[Any]:
        """The replies of `commands`, sent in one round trip; an error reply as its exception."""

    async def aclose(self) -> None: ...


def connect_round_trips(url: str, *, ride_out_outages: bool = True, cluster: bool = False) -> RoundTrips:
    """Round trips to the Redis at `url`, on hiredis where the URL is a plain `redis://` one."""
    client = connect_async_redis(url, ride_out_outages=ride_out_outages, cluster=cluster)
    pool = getattr(client, "connection_pool", None)
    if cluster or pool is None or pool.connection_class is not redis.asyncio.Connection:
        return PipelineRoundTrips(client)
    return HiredisRoundTrips(client)


class PipelineRoundTrips:
    """redis-py's pipeline, for what HiredisRoundTrips does not serve."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client

    async def run(self, *commands: Command) -> list[Any]:
        if len(commands) == 1 and commands[0][0] == "SCRIPT LOAD":
            # into every primary of a cluster, which a cluster's pipeline refuses to address at once
            try:
                return [await self.client.script_load(*commands[0][1:])]
            except redis.ResponseError as error:
                return [error]
        async with self.client.pipeline(transaction=False) as pipe:
            for command in commands:
                # by name: a cluster pipeline refuses its evalsha method, for keys that may lie in several
                # slots
                pipe.execute_command(*command)
            return await pipe.execute(raise_on_error=False)

    async def aclose(self) -> None:
        await self.client.aclose()


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.parser = hiredis.Reader(replyError=BaseParser.parse_error)

    async def round_trip(self, payload: bytes, replies: int) -> list[Any]:
        self.writer.write(payload)
        await self.writer.drain()
        out: list[Any] = []
        while len(out) < replies:
            reply = self.parser.gets()
            if reply is False:
                data = await self.reader.read(READ_SIZE)
                if not data:
                    raise redis.ConnectionError("Redis closed the connection")
                self.parser.feed(data)
            else:
                out.append(reply)
        return out

    def close(self) -> None:
        self.writer.close()


class HiredisRoundTrips:
    """Connections of its own to the Redis of `client` (a plain redis.asyncio client, as connect_async_redis
    makes it), as many at once as its pool allows, with its credentials, database and retry."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.client = client
        pool = client.connection_pool
        options = pool.connection_kwargs
        self.host = options.get("host", "localhost")
        self.port = int(options.get("port", 6379))
        self.connect_timeout_s = options.get("socket_connect_timeout") or ROUND_TRIP_TIMEOUT_S
        self.setup = self._setup_commands(options)
        self.retry = options.get("retry")
        if self.retry is not None:  # as redis-py's Connection does with the errors its client retries
            self.retry.update_supported_errors(options.get("retry_on_error", []))
        self.idle: list[_Connection] = []
        self.slots = asyncio.Semaphore(pool.max_connections)

    @staticmethod
    def _setup_commands(options: dict[str, Any]) -> list[Command]:
        commands: list[Command] = []
        if options.get("password") is not None:
            user = options.get("username")
            commands.append(("AUTH", user, options["password"]) if user else ("AUTH", options["password"]))
        if options.get("db"):
            commands.append(("SELECT", int(options["db"])))
        return commands

    async def run(self, *commands: Command) -> list[Any]:
        payload = b"".join(map(_packed, commands))
        try:
            replies = await self._round_trip(payload, len(commands))
        except (redis.ConnectionError, redis.TimeoutError, BusyLoadingError):
            if self.retry is None:
                raise
            # the retry's own loop from the second attempt on: its back-off, and the errors it does not retry
            replies = await self.retry.call_with_retry(lambda: self._round_trip(payload, len(commands)),
                                                       _nothing_to_undo)
        for index, command in enumerate(commands):
            shape = _SHAPES.get(command[0])
            if shape is not None and not isinstance(replies[index], Exception):
                replies[index] = shape(replies[index])
        return replies

    async def _round_trip(self, payload: bytes, replies: int) -> list[Any]:
        async with self.slots:
            connection = self.idle.pop() if self.idle else await self._connect()
            done = False
            try:
                async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S):
                    out = await connection.round_trip(payload, replies)
                done = True
            except TimeoutError as exc:
                raise redis.TimeoutError("Redis did not answer within "
                                         f"{ROUND_TRIP_TIMEOUT_S:g} s") from exc
            except (OSError, EOFError) as exc:
                raise redis.ConnectionError(f"lost the connection to Redis: {exc!r}") from exc
            finally:
                # A connection whose replies were not all read (cancelled, lost) is never reused.
                if done:
                    self.idle.append(connection)
                else:
                    connection.close()
        for reply in out:
            if isinstance(reply, BusyLoadingError):
                raise reply  # a restarted Redis still reading its data: an outage to wait out
        return out

    async def _connect(self) -> _Connection:
        """A new connection, logged in and on its database; a connection lost or stalled on the way there is a
        ConnectionError, as any other, which the retry waits out."""
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                connection = _Connection(*await asyncio.open_connection(self.host, self.port))
                try:
                    replies = await connection.round_trip(b"".join(map(_packed, self.setup)), len(self.setup))
                except BaseException:
                    connection.close()
                    raise
        except (OSError, EOFError) as exc:  # TimeoutError included
            where = f"{self.host}:{self.port}"
            raise redis.ConnectionError(f"cannot connect to Redis at {where}: {exc!r}") from exc
        refused = next((reply for reply in replies if isinstance(reply, Exception)), None)
        if refused is not None:  # redis-py's class: AuthenticationError for a login, never retried
            connection.close()
            raise refused
        return connection

    async def aclose(self) -> None:
        idle, self.idle = self.idle, []
        for connection in idle:
            connection.close()
        await self.client.aclose()


async def _nothing_to_undo(error: Exception) -> None:
    """The retry's failure hook: the round trip has closed its broken connection already."""
