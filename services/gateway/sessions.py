"""Gateway sessions in Redis: what a session is, and the tree of its turns.

Every gateway replica is stateless: a session's settings and every turn it sampled live under
`rs:{<run>}:state:gateway:session:<id>` (a hash), `...:nodes` (turn nodes by key) and `...:parents` (the
keys of nodes that have a child), so any replica serves any turn and a killed replica loses nothing.
Every key expires session_ttl_s after the session's last request, and a session with a time budget ends for
good at its deadline plus finish_grace_s (`ends_at`, fixed when it is created): the grace leaves room for the
finish that follows the budget killing the agent, and then the keys expire whether or not anyone finished it
(an agent-runner killed mid-episode never does). Redis itself ends it, so no replica has to be alive to sweep,
and a finish is one transaction that watches the keys: one that expire before it commits is refused whole,
nothing of it published.

A turn node is one generation: the tokens appended before it (prompt, or template glue and the new
messages, tokenized once: loss_mask 0), the ids vLLM sampled with their logprobs (loss_mask 1), the
policy versions, and its parent node. A node's key is a digest of the conversation it closes: the tools,
then every message up to and including the assistant message the gateway answered with, each as
`message_key` normalises it. A request whose history holds such a prefix continues from that node; a
history edited, compacted or branched past a node forks there (a second child), or starts a new root
when nothing matches. At finish every leaf (a node without a child) is one training sample; they share
the session's rollout id.

A session is created for a role of the run (SessionSpec.role), and each node records the role that sampled
it: the session's, or the one its request's model named (a sub-agent's). The node keys of a turn whose
request names a role are digests with that role in them, so that a conversation of one role never continues
another's: every sample is of one role.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis
from pydantic import ConfigDict, Field
from redis.exceptions import NoScriptError

from rollstream.shared.contract.bus import Bus, Keys
from rollstream.shared.contract.events import Count, Index, SampleGrading, TrajectoryTurn
from rollstream.shared.contract.redis_round_trips import Command, RoundTrips
from rollstream.shared.contract.run_facts import FLEET_VERSIONS

ROOT = ""
"""Parent key of a node that starts a conversation."""


class SessionGrading(SampleGrading):
    """The per-sample grading fields (shared/contract/events.py) as a session takes them: it is sample 0 of
    a group of 1 unless it says otherwise. The sessions API's create request has them as they are."""

    sample_index: Index = 0
    group_size: Count = 1


class SessionSpec(SessionGrading):
    """What a session is created with: the sample it becomes and how to sample it."""

    model_config = ConfigDict(extra="forbid")
    rollout_id: str
    group_id: str
    trajectory_id: str
    session_id: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    sampling: dict[str, Any] = Field(default_factory=dict)
    """Defaults for every turn: temperature, max_tokens, top_p, seed (a request's own values win), and
    min_tokens, ignore_eos (passed to vLLM)."""
    time_budget_s: float | None = None
    role: str | None = None
    """The role its turns are sampled as and train (its name; None: a session created before roles, the run's
    default), unless a request's model names another role of the run (turns.turn_role)."""


@dataclass
class Session:
    spec: SessionSpec
    key_digest: str
    status: str
    """open, or finished"""
    created_at: float
    turns: int = 0
    ends_at: float | None = None
    """When its keys expire at the latest, finished or not: the deadline plus the grace for the finish; None
    without a time budget (then session_ttl_s after its last request)."""
    fleet_versions: dict[str, int] = field(default_factory=dict)
    """The fleet's policy versions (server url -> version) when the session was read: a turn's versions
    before its generation (SessionStore.get reads them in the session's round trip)."""
    nodes: dict[str, TurnNode] = field(default_factory=dict)
    """Those of the turn nodes asked for with the session that exist (SessionStore.get's node_keys): for a
    request, the turns its history may continue."""

    @property
    def deadline(self) -> float | None:
        return self.created_at + self.spec.time_budget_s if self.spec.time_budget_s else None

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (now or time.time()) > self.deadline

    def accepts(self, api_key: str | None) -> bool:
        return api_key is not None and hmac.compare_digest(_digest(api_key), self.key_digest)

    def describe(self) -> dict[str, Any]:
        return {"session_id": self.spec.session_id, "status": self.status, "turns": self.turns,
                "rollout_id": self.spec.rollout_id, "group_id": self.spec.group_id, "role": self.spec.role,
                "created_at": self.created_at, "deadline": self.deadline, "ends_at": self.ends_at}


class TurnNode(msgspec.Struct, frozen=True):
    """One sampled turn, as the session's tree keeps it in Redis. It is not yet the contract's TrajectoryTurn:
    the segment a turn is in, and its number there, exist only once the session finishes and each leaf's chain
    becomes a sample, and a node that a conversation branched from is in the chain of every branch. It also
    keeps what the tree needs and no event carries: its parent, its answer's text, when it was sampled, and
    whether its prompt rewrote the history. `as_turn` makes the TrajectoryTurn of each place it has in the
    samples; a msgspec struct, because every turn of a session decodes its chain of nodes."""

    parent: str
    appended_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    policy_version: int
    policy_version_end: int
    finish_reason: str
    server_url: str
    response_text: str
    created_at: float
    history_rewritten: bool = False
    """The prompt continued recorded ids that the template now renders differently (prompts.PlannedTurn)."""
    role: str | None = None
    """The role that sampled it (None: a node recorded before roles, the session's). A chain never mixes
    roles: a turn of another role than its session's has node keys of its own (conversation_keys)."""

    def as_turn(self, number: int, segment_index: int, offset: int) -> TrajectoryTurn:
        """This node as turn `number` of a sample (segment `segment_index`) whose tokens have its response
        from `offset` on."""
        return TrajectoryTurn(turn=number, segment_index=segment_index, offset=offset,
                              appended_ids=self.appended_ids, response_ids=self.response_ids,
                              logprobs=self.logprobs, policy_version=self.policy_version,
                              policy_version_end=self.policy_version_end, finish_reason=self.finish_reason,
                              server_url=self.server_url)


_encoder = msgspec.msgpack.Encoder()
_node_decoder = msgspec.msgpack.Decoder(TurnNode)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _optional_float(raw: bytes | None) -> float | None:
    return None if raw is None else float(raw)


def conversation_keys(tools_key: str, message_keys: list[str], role: str | None = None) -> list[str]:
    """The node key of every prefix of the conversation: keys[i] closes messages[: i + 1]. `role`: the role a
    request names (its model) instead of its session's, whose conversations are apart from the session's own:
    the same messages sampled as another role are another sample."""
    seed = tools_key if role is None else f"{role}\x00{tools_key}"
    running = hashlib.blake2b(seed.encode(), digest_size=16)
    keys = []
    for key in message_keys:
        running.update(b"\x00" + key.encode())
        keys.append(running.copy().hexdigest())
    return keys


_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIREAT', KEYS[1], ARGV[1])
return 1
"""
"""KEYS: the session; ARGV: when it expires (ms), then its fields and values. 0: the id is taken."""
_ADD_TURN = """
if redis.call('HGET', KEYS[1], 'status') ~= 'open' then return 0 end
redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2])
if ARGV[3] ~= '' then redis.call('SADD', KEYS[3], ARGV[3]) end
redis.call('HINCRBY', KEYS[1], 'turns', 1)
local expire_at = tonumber(ARGV[4])
local ends_at = redis.call('HGET', KEYS[1], 'ends_at')
if ends_at then expire_at = math.min(expire_at, math.floor(tonumber(ends_at) * 1000)) end
for i = 1, 3 do redis.call('PEXPIREAT', KEYS[i], expire_at) end
return 1
"""
"""KEYS: the session, its nodes, its parents; ARGV: the node's key, the node, its parent ('' for ROOT), when
the keys expire (ms) unless the session ends sooner. 0: the session is not open."""
_AMEND = """
if redis.call('HGET', KEYS[1], 'status') == 'open' and redis.call('HGET', KEYS[2], ARGV[1]) == ARGV[2] then
    redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
end
return 1
"""
"""KEYS: the session, its nodes; ARGV: a node's key, the node as recorded, the node to record instead: while
the session is open and the node is still the one recorded."""


def _session_key(keys: Keys, session_id: str, *parts: str) -> str:
    return keys.state("gateway", "session", session_id, *parts)


def _session_keys(keys: Keys, session_id: str) -> list[str]:
    return [_session_key(keys, session_id), _session_key(keys, session_id, "nodes"),
            _session_key(keys, session_id, "parents")]


def _session_of(raw: dict[bytes, bytes], versions: dict[str, int] | None = None) -> Session | None:
    if b"spec" not in raw or b"key_digest" not in raw:
        return None
    spec = SessionSpec.model_validate_json(raw[b"spec"])
    return Session(spec=spec, key_digest=raw[b"key_digest"].decode(), status=raw[b"status"].decode(),
                   created_at=float(raw[b"created_at"]), turns=int(raw.get(b"turns", 0)),
                   ends_at=_optional_float(raw.get(b"ends_at")), fleet_versions=versions or {})


def _versions(raw: dict[bytes, bytes]) -> dict[str, int]:
    return {url.decode(): int(version) for url, version in raw.items()}


class _Script:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


_CREATE_SCRIPT, _ADD_TURN_SCRIPT, _AMEND_SCRIPT = _Script(_CREATE), _Script(_ADD_TURN), _Script(_AMEND)


class SessionStore:
    """Sessions of one run, on the run's Redis. What a turn does and creating and deleting a session run on
    the gateway's event loop (connect_round_trips: hiredis on a plain Redis, a fraction of redis-py's asyncio
    client's CPU), with no hop to a worker thread: a turn is two round trips, one that reads the session, the
    fleet's versions and the nodes its history holds, one that reads its server's version and records it.
    The creation and a turn's record are scripts, atomic on Redis. A finish is a WATCH transaction (it
    publishes the samples it read), which redis-py's asyncio cluster client does not run (8.1 never awaits the
    commands it sends after WATCH): it runs on the bus's own client, in a worker thread, once a session."""

    def __init__(self, bus: Bus, round_trips: RoundTrips, ttl_s: int, finish_grace_s: float) -> None:
        self.bus = bus
        """The run's keys, the finish's client, and its publisher: a finish queues the session's events on its
        own transaction."""
        self.round_trips = round_trips
        self.ttl_s = ttl_s
        self.finish_grace_s = finish_grace_s

    async def _replies(self, *commands: Command) -> list[Any]:
        replies = await self.round_trips.run(*commands)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def _script(self, script: _Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """The script's reply; loaded first where Redis does not hold it (a Redis that restarted has none)."""
        try:
            return (await self._replies(("EVALSHA", script.sha, len(keys), *keys, *args)))[0]
        except NoScriptError:
            await self._replies(("SCRIPT LOAD", script.source))
            return (await self._replies(("EVALSHA", script.sha, len(keys), *keys, *args)))[0]

    async def aclose(self) -> None:
        await self.round_trips.aclose()

    def _key(self, session_id: str, *parts: str) -> str:
        return _session_key(self.bus.keys, session_id, *parts)

    def _expire_at_ms(self, ends_at: float | None) -> int:
        """When a session's keys expire, touched now: session_ttl_s from now, or its end when that is sooner.
        Absolute, on the gateway's clock: Redis's must agree to within a fraction of the grace."""
        expiry = time.time() + self.ttl_s
        return int(1000 * (expiry if ends_at is None else min(expiry, ends_at)))

    async def create(self, spec: SessionSpec) -> tuple[Session, str] | None:
        """A new open session and its API key; None when the id is taken."""
        api_key = "rs-" + secrets.token_urlsafe(32)
        session = Session(spec=spec, key_digest=_digest(api_key), status="open", created_at=time.time())
        if session.deadline is not None:
            session.ends_at = session.deadline + self.finish_grace_s
        fields = {"spec": json.dumps(spec.model_dump()), "key_digest": session.key_digest, "status": "open",
                  "created_at": repr(session.created_at), "turns": 0}
        if session.ends_at is not None:
            fields["ends_at"] = repr(session.ends_at)
        # one script: a replica killed half-way must not leave a key that never expires
        args = [self._expire_at_ms(session.ends_at), *(item for pair in fields.items() for item in pair)]
        if not await self._script(_CREATE_SCRIPT, [self._key(spec.session_id)], args):
            return None
        return session, api_key

    async def get(self, session_id: str, node_keys: Sequence[str] = ()) -> Session | None:
        """The session, and in the same round trip the fleet's policy versions (Session.fleet_versions) and
        those of `node_keys` that exist (Session.nodes): for a request, the keys of the conversations its
        history holds, which are the chain of the deepest one (`chain` reads none of them again)."""
        commands: list[Command] = [("HGETALL", self._key(session_id)),
                                   ("HGETALL", FLEET_VERSIONS.key(self.bus.keys))]
        if node_keys:
            commands.append(("HMGET", self._key(session_id, "nodes"), *node_keys))
        raw, versions, *found = await self._replies(*commands)
        session = _session_of(raw, _versions(versions))
        if session is not None and found:
            session.nodes = {key: _node_decoder.decode(node) for key, node in zip(node_keys, found[0])
                             if node is not None}
        return session

    async def chain(self, session_id: str, key: str, known: dict[str, TurnNode]) -> list[TurnNode]:
        """The nodes from the conversation's root to `key`, in order; those in `known` are not read."""
        nodes_key = self._key(session_id, "nodes")
        out = []
        while key != ROOT:
            node = known.get(key)
            if node is None:
                (raw,) = await self._replies(("HGET", nodes_key, key))
                if raw is None:
                    raise KeyError(f"session {session_id}: turn node {key} is missing (expired?)")
                node = _node_decoder.decode(raw)
            out.append(node)
            key = node.parent
        return out[::-1]

    async def add_turn(self, session_id: str, key: str, node: TurnNode, version_field: str | None = None,
                       synced: bool = True) -> bool:
        """Record a sampled turn; False when the session is no longer open (finished meanwhile). The same
        conversation sampled twice to the same answer keeps the first. Its policy_version_end is the version
        the fleet's record holds under `version_field` (RunRoles.version_field: the node's role's policy on
        its server; None: the whole policy's, node.server_url) as it is recorded: the version after the
        generation; the node's own where the record has none, or where its role is never `synced` (a
        frozen role)."""
        # Redis lets a script name only keys its user may write, and the gateway's may only read the fleet's
        # record: it is read beside the script, in the same round trip, and the node amended in the rare turn
        # that a weight sync of its server ended during.
        keys = _session_keys(self.bus.keys, session_id)
        encoded = _encoder.encode(node)
        args = (key, encoded, node.parent, self._expire_at_ms(None))
        version_read: list[Command] = [("HGET", FLEET_VERSIONS.key(self.bus.keys),
                                        version_field or node.server_url)] if synced else []
        replies = await self.round_trips.run(*version_read,
                                             ("EVALSHA", _ADD_TURN_SCRIPT.sha, len(keys), *keys, *args))
        version, recorded = replies if synced else (None, *replies)
        if isinstance(recorded, NoScriptError):  # a Redis that restarted has none
            recorded = await self._script(_ADD_TURN_SCRIPT, keys, args)
        for reply in (version, recorded):
            if isinstance(reply, Exception):
                raise reply
        if recorded and version is not None and int(version) != node.policy_version_end:
            amended = msgspec.structs.replace(node, policy_version_end=int(version))
            await self._script(_AMEND_SCRIPT, keys[:2], [key, encoded, _encoder.encode(amended)])
        return bool(recorded)

    def samples(self, session_id: str, client=None) -> list[list[TurnNode]]:
        """The chain of every leaf (a node without a child), oldest leaf first: the session's samples."""
        client = client or self.bus.redis
        recorded = client.hgetall(self._key(session_id, "nodes"))
        nodes = {k.decode(): _node_decoder.decode(v) for k, v in recorded.items()}
        parents = {p.decode() for p in client.smembers(self._key(session_id, "parents"))}
        leaves = sorted((k for k in nodes if k not in parents), key=lambda k: (nodes[k].created_at, k))
        chains = []
        for leaf in leaves:
            chain, key = [], leaf
            while key != ROOT:
                chain.append(nodes[key])
                key = nodes[key].parent
            chains.append(chain[::-1])
        return chains

    def finish(self, session_id: str, publish_samples: Callable[[Any, list[list[TurnNode]]], None]) -> bool:
        """Open -> finished, once, in one transaction with what `publish_samples(pipe, samples)` queues (the
        samples' events): a crash between the two cannot publish twice or lose them, and a turn recorded
        meanwhile is either in the samples or refused. False when the session was not open. Blocking: on the
        bus's client."""
        key, nodes_key = self._key(session_id), self._key(session_id, "nodes")
        while True:
            with self.bus.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(key, nodes_key)
                    if pipe.hget(key, "status") != b"open":
                        return False
                    samples = self.samples(session_id, client=pipe)
                    pipe.multi()
                    publish_samples(pipe, samples)
                    pipe.hset(key, "status", "finished")
                    pipe.delete(nodes_key, self._key(session_id, "parents"))
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    async def delete(self, session_id: str) -> bool:
        (deleted,) = await self._replies(("DEL", *_session_keys(self.bus.keys, session_id)))
        return bool(deleted)


def open_sessions(bus: Bus) -> list[Session]:
    """Every session of the run that is open now, oldest first: a scan of the run's keys, for audits (the
    chaos harness's), not for serving."""
    sessions = []
    prefix = _session_key(bus.keys, "")
    for key in bus.redis.scan_iter(match=_session_key(bus.keys, "*"), count=1000):
        session_id = key.decode().removeprefix(prefix)
        if ":" in session_id:  # a session's nodes or parents (session ids have no colon)
            continue
        session = _session_of(bus.redis.hgetall(key))
        if session is not None and session.status == "open":
            sessions.append(session)
    return sorted(sessions, key=lambda session: session.created_at)


def expires_at(bus: Bus, session_id: str) -> float | None:
    """When the last of the session's keys expires (epoch seconds, on Redis's clock); None when one of them
    never does, 0 when none is left. For audits, as open_sessions."""
    pipe = bus.redis.pipeline(transaction=False)
    for key in _session_keys(bus.keys, session_id):
        pipe.pexpiretime(key)
    expiries = [ms for ms in pipe.execute() if ms != -2]  # -2: no such key (no turn yet, or finished)
    return None if -1 in expiries else max(expiries, default=0) / 1000
