"""Writes sent in one pipeline and confirmed by ``WAIT`` on the connection that made them.

``WAIT n timeout`` waits for the writes made *on its own connection*: a WAIT on another
connection, or on another node, confirms nothing of them. On one server the pipeline is one
connection, and one WAIT at its end covers every write.

On a Redis Cluster, redis-py's pipeline sends each node's commands in order on one connection
of that node, so a WAIT queued for a node after its writes covers them, as long as the writes
stay there. A slot that moved (MOVED) or is moving (ASK) breaks that: redis-py re-sends each
redirected command on its own, on the new owner, after the old owner's WAIT already answered
for writes it never made; the batch would read as confirmed while the new owner's replicas may
have none of it (and after a dropped connection it re-sends a node's commands routed afresh,
the WAIT to whichever node). So here each node's commands go out through the node itself
(``ClusterNode.execute_pipeline``: one connection, in order, once), each group's to its owner,
a WAIT per node after them; a redirected command is sent again in a next round, to the node the
redirection names (after ``ASKING`` for an ASK), with a WAIT on that node, and a group counts
as confirmed only when every node that applied any of its commands confirmed them.

A group is the unit of routing (on a cluster, every key of a group's commands shares the slot
of its ``route`` key) and of confirmation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from redis.asyncio.cluster import PipelineCommand
from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError

from embedfleet.shared.fault_kinds import is_transient
from embedfleet.shared.redis_conn import is_cluster

G = TypeVar("G", bound=Hashable)
Command = tuple[Any, ...]
# Redirections followed within one call before it is left to the caller's retry (redis-py
# follows 16 per command; a slot moves once per migration)
MAX_ROUNDS = 5


@dataclass(frozen=True)
class Group(Generic[G]):
    """``commands`` of one group, routed by ``route`` (a key in the group's slot)."""

    route: str
    commands: Sequence[Command]


@dataclass
class Written(Generic[G]):
    """Each group's replies, in its commands' order, and the groups whose writes fewer than
    ``min_replicas`` replicas confirmed (empty without ``min_replicas``)."""

    replies: dict[G, list[Any]]
    unconfirmed: set[G]


class _RoundTrip(Generic[G]):
    """Commands per node, each node's sent in order on one of its connections, once: no
    redirection followed and no retry on another connection behind this code's back (redis-py's
    pipeline re-sends a failed node's commands routed afresh, a WAIT among them)."""

    def __init__(self) -> None:
        self.batches: dict[str, tuple[Any, list[PipelineCommand]]] = {}
        self.sent: list[tuple[PipelineCommand, tuple[G, int] | None]] = []  # None: ASKING, WAIT

    def queue(self, node: Any, command: Command, what: tuple[G, int] | None) -> PipelineCommand:
        queued = PipelineCommand(len(self.sent), *command)
        self.batches.setdefault(node.name, (node, []))[1].append(queued)
        self.sent.append((queued, what))
        return queued

    async def send(self) -> None:
        """Every node's commands, the nodes in parallel; each command's ``result`` is its reply
        or its error. Raises when a node could not be reached at all."""
        await asyncio.gather(
            *(node.execute_pipeline(commands) for node, commands in self.batches.values())
        )


async def write_confirmed(
    client: Any, groups: Mapping[G, Group[G]], min_replicas: int, timeout_ms: int
) -> Written[G]:
    """Send every group's commands in one pipelined round trip (per node; a few more after a
    redirection) and, with ``min_replicas``, confirm them with WAIT. An error reply other than a
    redirection is raised; after an unreachable node or CLUSTERDOWN the cluster client is told
    to read the cluster's layout again (a failover moved its masters)."""
    if not is_cluster(client):
        return await _write_single(client, groups, min_replicas, timeout_ms)
    return await _write_cluster(client, groups, min_replicas, timeout_ms)


async def _write_single(
    client: Any, groups: Mapping[G, Group[G]], min_replicas: int, timeout_ms: int
) -> Written[G]:
    pipe = client.pipeline(transaction=False)
    for group in groups.values():
        for command in group.commands:
            pipe.execute_command(*command)
    if min_replicas:
        pipe.execute_command("WAIT", min_replicas, timeout_ms)
    replies = await pipe.execute()
    written: Written[G] = Written({}, set())
    position = 0
    for name, group in groups.items():
        written.replies[name] = replies[position : position + len(group.commands)]
        position += len(group.commands)
    if min_replicas and int(replies[-1]) < min_replicas:
        written.unconfirmed = set(groups)
    return written


async def _write_cluster(
    client: Any, groups: Mapping[G, Group[G]], min_replicas: int, timeout_ms: int
) -> Written[G]:
    written: Written[G] = Written(
        {name: [None] * len(group.commands) for name, group in groups.items()}, set()
    )
    pending = {name: list(range(len(group.commands))) for name, group in groups.items()}
    asking: dict[G, Any] = {}  # group -> the node an ASK named (for the next round only)
    redirect: AskError | None = None
    for _ in range(MAX_ROUNDS):
        if not pending:
            return written
        await client.initialize()  # the layout again, after a fault below asked for it
        trip, waits = _queue_round(client, groups, pending, asking, min_replicas, timeout_ms)
        try:
            await trip.send()
        except Exception as error:  # a node unreachable: nothing of its commands is known
            if is_transient(error):
                # as redis-py's pipeline does: a failover may have moved the masters
                await client.aclose()
            raise
        replies = await _read_round(client, trip, written)
        pending, asking = replies.pending, replies.asking
        redirect = replies.redirect or redirect
        for queued, names in waits:
            reply = queued.result
            if isinstance(reply, Exception) or int(reply) < min_replicas:
                written.unconfirmed.update(name for name in names if name in replies.applied)
        if replies.failure is not None:
            if isinstance(replies.failure, (ClusterDownError, AskError)):  # an unknown node
                await client.aclose()  # the layout changed: read it again on the next call
            raise replies.failure
    if pending:
        assert redirect is not None
        raise redirect  # transient: the caller's retry sends the groups again
    return written


def _queue_round(
    client: Any,
    groups: Mapping[G, Group[G]],
    pending: dict[G, list[int]],
    asking: dict[G, Any],
    min_replicas: int,
    timeout_ms: int,
) -> tuple[_RoundTrip[G], list[tuple[PipelineCommand, list[G]]]]:
    """A round's commands queued, each group's pending ones to its owner (or the node an ASK
    named), a WAIT per node after them with ``min_replicas``; and each WAIT with the groups
    sent to its node."""
    trip: _RoundTrip[G] = _RoundTrip()
    nodes: dict[str, tuple[Any, list[G]]] = {}
    for name, indices in pending.items():
        node = asking.get(name) or client.get_node_from_key(groups[name].route)
        for index in indices:
            if name in asking:  # ASKING lets only the next command in
                trip.queue(node, ("ASKING",), None)
            trip.queue(node, groups[name].commands[index], (name, index))
        nodes.setdefault(node.name, (node, []))[1].append(name)
    waits: list[tuple[PipelineCommand, list[G]]] = []  # a node's WAIT, the groups sent there
    if min_replicas:
        for node, names in nodes.values():
            wait = trip.queue(node, ("WAIT", min_replicas, timeout_ms), None)
            waits.append((wait, names))
    return trip, waits


@dataclass
class _RoundReplies(Generic[G]):
    """What a round's replies tell: the commands to send again next round (``asking``: the
    groups to send to the node an ASK named), the groups some node applied commands of, the
    error to raise, if any, and the latest redirection."""

    pending: dict[G, list[int]] = field(default_factory=dict)
    asking: dict[G, Any] = field(default_factory=dict)
    applied: set[G] = field(default_factory=set)
    failure: BaseException | None = None
    redirect: AskError | None = None


async def _read_round(client: Any, trip: _RoundTrip[G], written: Written[G]) -> _RoundReplies[G]:
    """Each reply of a round into ``written``; a redirected command pending again (the
    client's slot map updated for a MOVED)."""
    replies: _RoundReplies[G] = _RoundReplies()
    for queued, what in trip.sent:
        reply = queued.result
        if what is None:
            if isinstance(reply, Exception) and replies.failure is None:
                replies.failure = reply  # an ASKING or a WAIT that failed
            continue
        name, index = what
        if isinstance(reply, MovedError):  # the slot moved: the cluster's layout changed
            replies.redirect = reply
            await client.nodes_manager.move_slot(reply)
            replies.pending.setdefault(name, []).append(index)
        elif isinstance(reply, AskError):  # the slot is moving: this key is on the target
            replies.redirect = reply
            target = client.get_node(host=reply.host, port=reply.port)
            if target is None:  # a node the client does not know yet
                replies.failure = replies.failure or reply
                continue
            replies.asking[name] = target
            replies.pending.setdefault(name, []).append(index)
        elif isinstance(reply, Exception):
            if replies.failure is None or isinstance(replies.failure, TryAgainError):
                replies.failure = reply
        else:
            written.replies[name][index] = reply
            replies.applied.add(name)
    return replies
