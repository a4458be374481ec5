"""A real Redis Cluster on loopback: 3 masters + 3 replicas of ``redis-server``, for the cluster
tests and ``python -m loadtest.cluster``.

Every node is a ``redis-server --cluster-enabled yes`` child in a temporary directory, joined by
``redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes``. Ports are below 55536
because a cluster node also listens on its port + 10000 (the cluster bus). A short
``cluster-node-timeout`` makes a failover take about a second instead of fifteen.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from embedfleet.server import ServerProcess, system_server_binary

HIGHEST_PORT = 55535  # the bus port (port + 10000) must exist too
NODE_TIMEOUT_MS = 1000


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_ports(count: int) -> list[int]:
    """``count`` free ports below 55536 whose bus ports (+10000) are free as well."""
    ports: list[int] = []
    start = 20000 + (os.getpid() * 37) % 20000  # parallel test runs start apart
    candidate = start
    while len(ports) < count:
        candidate = 20000 + (candidate - 20000 + 1) % (HIGHEST_PORT - 10000 - 20000)
        if candidate == start:
            raise RuntimeError("no free loopback ports below 55536 for a cluster")
        if _port_is_free(candidate) and _port_is_free(candidate + 10000):
            ports.append(candidate)
    return ports


@dataclass(frozen=True)
class ClusterNode:
    node_id: str
    port: int
    master: bool
    master_id: str | None
    slots: tuple[tuple[int, int], ...]
    failed: bool

    def holds(self, slot: int) -> bool:
        return any(first <= slot <= last for first, last in self.slots)


class LocalCluster:
    """Start with ``with LocalCluster() as cluster:``; ``cluster.url`` is a seed node's URL."""

    def __init__(self, masters: int = 3, replicas_per_master: int = 1) -> None:
        binary = system_server_binary()
        if binary is None:
            raise RuntimeError("a Redis Cluster needs redis-server on PATH (apt install redis)")
        self.binary = binary
        self.size = masters * (1 + replicas_per_master)
        self.replicas_per_master = replicas_per_master
        self.servers: dict[int, ServerProcess] = {}
        self._revived_dirs: list[Path] = []

    @property
    def url(self) -> str:
        """A cluster URL (``redis+cluster://``) on the first live node."""
        return f"redis+cluster://127.0.0.1:{self.live_ports()[0]}/0"

    def live_ports(self) -> list[int]:
        return [
            port
            for port, server in self.servers.items()
            if server.process is not None and server.process.poll() is None
        ]

    def start(self, timeout: float = 60.0) -> LocalCluster:
        for port in free_cluster_ports(self.size):
            self.servers[port] = ServerProcess(
                self.binary,
                port=port,
                extra_args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    str(NODE_TIMEOUT_MS),
                    # a replica may fail over however long it was cut off (tests kill masters)
                    "--cluster-replica-validity-factor",
                    "0",
                ],
            ).start()
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in self.servers),
                "--cluster-replicas",
                str(self.replicas_per_master),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        self.wait_healthy(timeout)
        return self

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()
        for directory in self._revived_dirs:
            shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- looking at it ---------------------------------------------------------------------
    def client(self, port: int | None = None) -> redis.Redis:
        """A plain client on one node (``port``, default the first live one)."""
        return redis.Redis(port=port or self.live_ports()[0], socket_timeout=5)

    def nodes(self) -> list[ClusterNode]:
        """``CLUSTER NODES`` as one live node sees it."""
        with contextlib.closing(self.client()) as client:
            text = client.execute_command("CLUSTER", "NODES")
        text = text.decode() if isinstance(text, bytes) else text
        parsed = []
        for line in text.strip().splitlines():
            fields = line.split()
            flags = fields[2].split(",")
            slots = []
            for part in fields[8:]:
                if part.startswith("["):
                    continue  # a slot being migrated or imported
                first, _, last = part.partition("-")
                slots.append((int(first), int(last or first)))
            parsed.append(
                ClusterNode(
                    node_id=fields[0],
                    port=int(fields[1].split(":")[1].split("@")[0]),
                    master="master" in flags,
                    master_id=None if fields[3] == "-" else fields[3],
                    slots=tuple(slots),
                    failed="fail" in flags or "fail?" in flags,
                )
            )
        return parsed

    def masters(self) -> list[ClusterNode]:
        return [node for node in self.nodes() if node.master and not node.failed and node.slots]

    def master_of(self, slot: int) -> ClusterNode:
        return next(node for node in self.masters() if node.holds(slot))

    def replicas_of(self, master: ClusterNode) -> list[ClusterNode]:
        return [n for n in self.nodes() if n.master_id == master.node_id and not n.failed]

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until every live node says cluster_state:ok, every slot is served, the nodes agree
        on the masters, and every replica's link to its master is up."""
        deadline = time.monotonic() + timeout
        problem = "not checked yet"
        while time.monotonic() < deadline:
            problem = self._health_problem()
            if problem is None:
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster not healthy after {timeout}s: {problem}")

    def _health_problem(self) -> str | None:
        views: set[tuple[tuple[int, tuple[tuple[int, int], ...]], ...]] = set()
        for port in self.live_ports():
            with contextlib.closing(self.client(port)) as client:
                try:
                    info = client.execute_command("CLUSTER", "INFO")
                    replication = client.info("replication")
                except redis.RedisError as error:
                    return f"node {port}: {error}"
            info = info.decode() if isinstance(info, bytes) else info
            if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
                return f"node {port}: cluster_state not ok yet"
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return f"replica {port}: master_link_status {replication.get('master_link_status')}"
        try:
            masters = self.masters()
        except redis.RedisError as error:
            return str(error)
        views.add(tuple(sorted((m.port, m.slots) for m in masters)))
        if sum(last - first + 1 for m in masters for first, last in m.slots) != 16384:
            return "the masters do not cover the 16384 slots yet"
        for master in masters:
            if len(self.replicas_of(master)) < self.replicas_per_master:
                return f"master {master.port} has no replica yet"
        return None

    # --- breaking it -------------------------------------------------------------------------
    def kill(self, port: int) -> None:
        """SIGKILL one node: no goodbye to its replicas, exactly like a crashed machine."""
        process = self.servers[port].process
        assert process is not None
        os.kill(process.pid, signal.SIGKILL)
        process.wait()

    def revive(self, port: int) -> None:
        """Start a killed node again on its own data directory: it knows the cluster from its
        nodes.conf and rejoins, as a replica of the master that took its slots."""
        old = self.servers[port]
        self._revived_dirs.append(old.data_dir)
        self.servers[port] = ServerProcess(
            self.binary, port=port, extra_args=old.extra_args, data_dir=old.data_dir
        ).start()

    def wait_failover(self, dead_port: int, timeout: float = 30.0) -> int:
        """Until a replica of the killed master serves its slots; returns the new master's port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError, StopIteration):
                masters = self.masters()
                if all(node.port != dead_port for node in masters) and self._all_ok():
                    covered = sum(last - first + 1 for m in masters for first, last in m.slots)
                    if covered == 16384:
                        return next(m.port for m in masters if m.port not in self._old_masters)
            time.sleep(0.1)
        raise RuntimeError(f"no replica took over from {dead_port} within {timeout}s")

    def remember_masters(self) -> None:
        self._old_masters = {node.port for node in self.masters()}

    def _all_ok(self) -> bool:
        for port in self.live_ports():
            with contextlib.closing(self.client(port)) as client:
                info = client.execute_command("CLUSTER", "INFO")
            info = info.decode() if isinstance(info, bytes) else info
            if "cluster_state:ok" not in info:
                return False
        return True

    def reshard(self, slot: int, to_port: int) -> None:
        """``redis-cli --cluster reshard``: move slots from the master holding ``slot`` to the
        master on ``to_port``, as many as it takes for ``slot`` to go (redis-cli moves a source's
        slots lowest first)."""
        source = self.master_of(slot)
        target = next(node for node in self.masters() if node.port == to_port)
        first = min(low for low, _ in source.slots)
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "reshard",
                f"127.0.0.1:{source.port}",
                "--cluster-from",
                source.node_id,
                "--cluster-to",
                target.node_id,
                "--cluster-slots",
                str(slot - first + 1),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def move_slot(self, slot: int, to_port: int, *, finish: bool = True) -> None:
        """Move one slot by hand, the steps ``redis-cli --cluster reshard`` takes: IMPORTING on
        the target, MIGRATING on the source, MIGRATE of every key in the slot, then (``finish``)
        the target named as the slot's owner on every master. Unfinished, the slot is left
        half-moved: the source answers ASK for the keys it no longer holds."""
        source = self.master_of(slot)
        target = next(node for node in self.masters() if node.port == to_port)
        with (
            contextlib.closing(self.client(source.port)) as from_client,
            contextlib.closing(self.client(to_port)) as to_client,
        ):
            to_client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source.node_id)
            from_client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target.node_id)
            while keys := from_client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                from_client.execute_command(
                    "MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "KEYS", *keys
                )
        if finish:
            self.finish_slot_move(slot, to_port)

    def finish_slot_move(self, slot: int, to_port: int) -> None:
        """Name the node on ``to_port`` the owner of ``slot`` on every master (the target
        first, as redis-cli does), and wait until the nodes agree."""
        target = next(node for node in self.nodes() if node.port == to_port)
        ports = [to_port, *(m.port for m in self.masters() if m.port != to_port)]
        for port in ports:
            with contextlib.closing(self.client(port)) as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target.node_id)
        self.wait_healthy()
        if self.master_of(slot).port != to_port:
            raise RuntimeError(f"slot {slot} is not on {to_port} after the move")

    def pause(self, port: int) -> None:
        """SIGSTOP one node: it holds its sockets open and answers nothing (a hung machine)."""
        process = self.servers[port].process
        assert process is not None
        os.kill(process.pid, signal.SIGSTOP)

    def resume(self, port: int) -> None:
        process = self.servers[port].process
        assert process is not None
        os.kill(process.pid, signal.SIGCONT)
