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
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis
from pydantic import ConfigDict, Field

from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import Count, Index, SampleGrading, TrajectoryTurn

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

    @property
    def deadline(self) -> float | None:
        return self.created_at + self.spec.time_budget_s if self.spec.time_budget_s else None

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (now or time.time()) > self.deadline

    def accepts(self, api_key: str | None) -> bool:
        return api_key is not None and hmac.compare_digest(_digest(api_key), self.key_digest)

    def describe(self) -> dict[str, Any]:
        return {"session_id": self.spec.session_id, "status": self.status, "turns": self.turns,
                "rollout_id": self.spec.rollout_id, "group_id": self.spec.group_id,
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

    def as_turn(self, number: int, segment_index: int, offset: int) -> TrajectoryTurn:
        """This node as turn `number` of a sample (segment `segment_index`) whose tokens have its response
        from `offset` on."""
        return TrajectoryTurn(turn=number, segment_index=segment_index, offset=offset, appended_ids=self.appended_ids,
                              response_ids=self.response_ids, logprobs=self.logprobs,
                              policy_version=self.policy_version, policy_version_end=self.policy_version_end,
                              finish_reason=self.finish_reason, server_url=self.server_url)


_encoder = msgspec.msgpack.Encoder()
_node_decoder = msgspec.msgpack.Decoder(TurnNode)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _optional_float(raw: bytes | None) -> float | None:
    return None if raw is None else float(raw)


def conversation_keys(tools_key: str, message_keys: list[str]) -> list[str]:
    """The node key of every prefix of the conversation: keys[i] closes messages[: i + 1]."""
    running = hashlib.blake2b(tools_key.encode(), digest_size=16)
    keys = []
    for key in message_keys:
        running.update(b"\x00" + key.encode())
        keys.append(running.copy().hexdigest())
    return keys


class SessionStore:
    """Sessions of one run, on the run's Redis."""

    def __init__(self, bus: Bus, ttl_s: int, finish_grace_s: float) -> None:
        self.bus = bus
        self.redis = bus.redis
        self.ttl_s = ttl_s
        self.finish_grace_s = finish_grace_s

    def _key(self, session_id: str, *parts: str) -> str:
        return self.bus.keys.state("gateway", "session", session_id, *parts)

    def _keys(self, session_id: str) -> list[str]:
        return [self._key(session_id), self._key(session_id, "nodes"), self._key(session_id, "parents")]

    def _expire_at_ms(self, ends_at: float | None) -> int:
        """When a session's keys expire, touched now: session_ttl_s from now, or its end when that is sooner.
        Absolute, on the gateway's clock: Redis's must agree to within a fraction of the grace."""
        expiry = time.time() + self.ttl_s
        return int(1000 * (expiry if ends_at is None else min(expiry, ends_at)))

    def create(self, spec: SessionSpec) -> tuple[Session, str] | None:
        """A new open session and its API key; None when the id is taken."""
        api_key = "rs-" + secrets.token_urlsafe(32)
        session = Session(spec=spec, key_digest=_digest(api_key), status="open", created_at=time.time())
        if session.deadline is not None:
            session.ends_at = session.deadline + self.finish_grace_s
        fields = {"spec": json.dumps(spec.model_dump()), "key_digest": session.key_digest, "status": "open",
                  "created_at": repr(session.created_at), "turns": 0}
        if session.ends_at is not None:
            fields["ends_at"] = repr(session.ends_at)
        key = self._key(spec.session_id)
        # one transaction: a replica killed half-way must not leave a key that never expires
        with self.redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(key)
                if pipe.exists(key):
                    return None
                pipe.multi()
                pipe.hset(key, mapping=fields)
                pipe.pexpireat(key, self._expire_at_ms(session.ends_at))
                pipe.execute()
            except redis.WatchError:  # created meanwhile by another request
                return None
        return session, api_key

    def get(self, session_id: str) -> Session | None:
        raw = self.redis.hgetall(self._key(session_id))
        if b"spec" not in raw or b"key_digest" not in raw:
            return None
        spec = SessionSpec.model_validate(json.loads(raw[b"spec"]))
        return Session(spec=spec, key_digest=raw[b"key_digest"].decode(),
                       status=raw[b"status"].decode(), created_at=float(raw[b"created_at"]),
                       turns=int(raw.get(b"turns", 0)), ends_at=_optional_float(raw.get(b"ends_at")))

    def open_sessions(self) -> list[Session]:
        """Every session of the run that is open now, oldest first (a scan of the run's keys: for audits, not
        for serving)."""
        sessions = []
        for key in self.redis.scan_iter(match=self._key("*"), count=1000):
            session_id = key.decode().removeprefix(self._key(""))
            if ":" in session_id:  # a session's nodes or parents (session ids have no colon)
                continue
            session = self.get(session_id)
            if session is not None and session.status == "open":
                sessions.append(session)
        return sorted(sessions, key=lambda session: session.created_at)

    def expires_at(self, session_id: str) -> float | None:
        """When the last of the session's keys expires (epoch seconds, on Redis's clock); None when one of them
        never does, 0 when none is left."""
        pipe = self.redis.pipeline(transaction=False)
        for key in self._keys(session_id):
            pipe.pexpiretime(key)
        expiries = [ms for ms in pipe.execute() if ms != -2]  # -2: no such key (no turn yet, or finished)
        return None if -1 in expiries else max(expiries, default=0) / 1000

    def deepest_known(self, session_id: str, candidates: list[str]) -> tuple[str, TurnNode] | None:
        """Of the node keys a request's history could continue (deepest last), the deepest that exists."""
        if not candidates:
            return None
        found = self.redis.hmget(self._key(session_id, "nodes"), candidates)
        for key, raw in zip(reversed(candidates), reversed(found)):
            if raw is not None:
                return key, _node_decoder.decode(raw)
        return None

    def chain(self, session_id: str, key: str, client=None) -> list[TurnNode]:
        """The nodes from the conversation's root to `key`, in order."""
        client = client or self.redis
        nodes_key = self._key(session_id, "nodes")
        out = []
        while key != ROOT:
            raw = client.hget(nodes_key, key)
            if raw is None:
                raise KeyError(f"session {session_id}: turn node {key} is missing (expired?)")
            node = _node_decoder.decode(raw)
            out.append(node)
            key = node.parent
        return out[::-1]

    def add_turn(self, session_id: str, key: str, node: TurnNode) -> bool:
        """Record a sampled turn; False when the session is no longer open (finished meanwhile). The same
        conversation sampled twice to the same answer keeps the first."""
        session_key, nodes_key, parents_key = self._keys(session_id)
        while True:  # another turn of the session recorded meanwhile: read the status again
            with self.redis.pipeline(transaction=True) as pipe:
                try:
                    pipe.watch(session_key)
                    status, ends_at = pipe.hmget(session_key, "status", "ends_at")
                    if status != b"open":
                        return False
                    pipe.multi()
                    pipe.hsetnx(nodes_key, key, _encoder.encode(node))
                    if node.parent != ROOT:
                        pipe.sadd(parents_key, node.parent)
                    pipe.hincrby(session_key, "turns", 1)
                    expire_at_ms = self._expire_at_ms(_optional_float(ends_at))
                    for each in (session_key, nodes_key, parents_key):
                        pipe.pexpireat(each, expire_at_ms)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    def samples(self, session_id: str, client=None) -> list[list[TurnNode]]:
        """The chain of every leaf (a node without a child), oldest leaf first: the session's samples."""
        client = client or self.redis
        nodes = {k.decode(): _node_decoder.decode(v) for k, v in client.hgetall(self._key(session_id, "nodes")).items()}
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
        meanwhile is either in the samples or refused. False when the session was not open."""
        key, nodes_key = self._key(session_id), self._key(session_id, "nodes")
        while True:
            with self.redis.pipeline(transaction=True) as pipe:
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

    def delete(self, session_id: str) -> bool:
        return bool(self.redis.delete(*self._keys(session_id)))
