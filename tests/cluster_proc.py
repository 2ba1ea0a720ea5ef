"""A real local Redis Cluster for the tests: 3 masters + 3 replicas, every node a redis-server process
on free ports of 127.0.0.1 (client port and cluster-bus port both), each in its own temp folder that
holds its nodes.conf, its redis.log and (when asked) its AOF, and nothing else."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from worker.service.redis_proc import RedisProcess, free_port

N_SLOTS = 16384
# A node that has not answered the cluster bus for this long is failing. Not less: on a busy 2-core
# machine a node fsyncing every write can miss a shorter window, and the cluster would fail over.
NODE_TIMEOUT_MS = 2000
POLL = 0.03
# (start, end, master port, replica ports) for each range of CLUSTER SLOTS
SlotMap = list[tuple[int, int, int, tuple[int, ...]]]


class ClusterNode:
    """One cluster-enabled redis-server. A restart (`start()` after `stop()`) reuses its ports and
    folder, so it reloads its nodes.conf (and AOF) and rejoins the cluster as the same node."""

    def __init__(
        self,
        folder: Path,
        *,
        port: int | None = None,
        bus_port: int | None = None,
        node_timeout_ms: int = NODE_TIMEOUT_MS,
        appendonly: bool = True,
        extra_args: list[str] | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.port = port or free_port()
        self.bus_port = bus_port or _free_port_except({self.port})
        args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(self.folder / "nodes.conf"),
            "--cluster-port",
            str(self.bus_port),
            "--cluster-node-timeout",
            str(node_timeout_ms),
            "--cluster-replica-no-failover",
            "no",
            "--cluster-allow-replica-migration",
            "no",
            # a replica may always fail over, however long since it last heard from its master
            "--cluster-replica-validity-factor",
            "0",
            # no 5 s wait before a full sync (the default): a (re)joined replica is in sync at once
            "--repl-diskless-sync-delay",
            "0",
            # a replica loads the full sync from the socket: no dump.rdb on disk
            "--repl-diskless-load",
            "swapdb",
            *(extra_args or []),
        ]
        self.proc = RedisProcess(self.port, appendonly=appendonly, data_dir=self.folder, extra_args=args)
        self._id: str | None = None
        self._client: redis.Redis | None = None

    def __repr__(self) -> str:
        return f"<ClusterNode 127.0.0.1:{self.port}>"

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        p = self.proc.proc
        return p is not None and p.poll() is None

    def start(self) -> ClusterNode:
        """Start (or restart on the same port and folder) and wait until it answers PING."""
        try:
            self.proc.start()
        except RuntimeError as e:
            raise RuntimeError(f"{self}: {e}\n{self.log()}") from None
        return self

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (clean shutdown) or SIGKILL (crash) the server and wait for it."""
        if self._client is not None:
            self._client.close()
        self.proc.stop(kill=kill)

    def admin(self) -> redis.Redis:
        """A new plain client of this node (the caller closes it)."""
        return redis.Redis(port=self.port, socket_timeout=5, decode_responses=True)

    def call(self, *args: Any) -> Any:
        """One command on a client this node keeps (raw reply, no redis-py callbacks)."""
        if self._client is None:
            self._client = self.admin()
        return self._client.execute_command(*args)

    def node_id(self) -> str:
        if self._id is None:
            self._id = self.call("CLUSTER", "MYID")
        return self._id

    def info(self, field: str, section: str = "all") -> Any:
        """A field of INFO (ints as ints); None while the node is down or loading."""
        try:
            return self.call("INFO", section).get(field)
        except (redis.ConnectionError, redis.TimeoutError):
            return None

    def role(self) -> str | None:
        """'master' or 'slave' (None while down)."""
        return self.info("role", "replication")

    def cluster_info(self) -> dict[str, str]:
        """CLUSTER INFO as a dict ({} while down)."""
        try:
            text = self.call("CLUSTER", "INFO")
        except (redis.ConnectionError, redis.TimeoutError):
            return {}
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def slot_map(self) -> SlotMap | None:
        """This node's CLUSTER SLOTS, sorted (None while down)."""
        try:
            reply = self.call("CLUSTER", "SLOTS")
        except (redis.ConnectionError, redis.TimeoutError):
            return None
        return sorted((r[0], r[1], int(r[2][1]), tuple(sorted(int(x[1]) for x in r[3:]))) for r in reply)

    def log(self, chars: int = 3000) -> str:
        path = self.folder / "redis.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


class RedisCluster:
    """3 masters, each with 1 replica, made with `redis-cli --cluster create`. `url` is the
    redis+cluster:// URL naming the first masters; roles change on failover, so `masters()`,
    `replicas()` and the rest ask the nodes each time."""

    def __init__(
        self,
        *,
        masters: int = 3,
        node_timeout_ms: int = NODE_TIMEOUT_MS,
        appendonly: bool = True,
        node_args: list[str] | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.n_masters = masters
        self.node_timeout_ms = node_timeout_ms
        self.appendonly = appendonly
        self.node_args = list(node_args or [])
        self.timeout = timeout
        self.folder = Path(tempfile.mkdtemp(prefix="pagedq-cluster-"))
        self.nodes: list[ClusterNode] = []
        self.initial_masters: list[ClusterNode] = []

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> RedisCluster:
        try:
            self._start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def _start(self) -> None:
        taken: set[int] = set()
        for i in range(self.n_masters * 2):
            port = _free_port_except(taken)
            bus = _free_port_except(taken | {port})
            taken |= {port, bus}
            folder = self.folder / f"node-{i}"
            folder.mkdir()
            node = ClusterNode(
                folder,
                port=port,
                bus_port=bus,
                node_timeout_ms=self.node_timeout_ms,
                appendonly=self.appendonly,
                extra_args=self.node_args,
            )
            self.nodes.append(node)
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli not found on PATH: install it (apt-get install redis-tools)")
        cmd = [cli, "--cluster", "create", *(n.addr for n in self.nodes), "--cluster-replicas", "1"]
        try:
            done = subprocess.run(
                [*cmd, "--cluster-yes"], capture_output=True, text=True, timeout=self.timeout, check=False
            )
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(
                f"redis-cli --cluster create hung for {self.timeout}s: {e.stdout}\n{self.logs()}"
            ) from None
        if done.returncode != 0 or "[OK] All 16384 slots covered" not in done.stdout:
            out = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)  # its colours
            raise RuntimeError(f"redis-cli --cluster create failed ({done.returncode}):\n{out}\n{self.logs()}")
        # CLUSTER SLOTS lists a replica only once its replication offset is not 0, which without a
        # write takes until the master's first replication PING (10 s): a FLUSHALL moves it now.
        for node in self.nodes:
            if node.role() == "master":
                node.call("FLUSHALL")
        self._wait(self._healthy, self.timeout, "the new cluster to be ok and agree on its slots")
        self.initial_masters = self.masters()

    def cleanup(self) -> None:
        """Stop every node and remove their folders."""
        errors = []
        for node in self.nodes:
            try:
                node.stop()
            except Exception as e:  # stop the others all the same
                errors.append(e)
        shutil.rmtree(self.folder, ignore_errors=True)
        if errors:
            raise errors[0]

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()

    # --- who is who ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.addr for n in self.initial_masters)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", n.port) for n in self.nodes]

    def live(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.running]

    def masters(self) -> list[ClusterNode]:
        """The live nodes that say they are masters now."""
        return [n for n in self.live() if n.role() == "master"]

    def replicas(self) -> list[ClusterNode]:
        return [n for n in self.live() if n.role() == "slave"]

    def node_by_port(self, port: int) -> ClusterNode:
        for n in self.nodes:
            if n.port == port:
                return n
        raise KeyError(f"no cluster node on port {port}")

    def slot_of(self, key: str) -> int:
        return int(self._any_master().call("CLUSTER", "KEYSLOT", key))

    def master_of_slot(self, slot: int) -> ClusterNode:
        """The master that a live master's CLUSTER SLOTS gives the slot to."""
        for start, end, port, _ in self._any_master().slot_map() or []:
            if start <= slot <= end:
                return self.node_by_port(port)
        raise RuntimeError(f"slot {slot} is not served by any node\n{self.logs()}")

    def replica_of(self, master: ClusterNode) -> ClusterNode:
        """The live replica that replicates `master` (one with its link up, if there are several)."""
        found = [n for n in self.replicas() if n.info("master_port", "replication") == master.port]
        if not found:
            raise RuntimeError(f"{master} has no live replica\n{self.logs()}")
        return next((n for n in found if n.info("master_link_status", "replication") == "up"), found[0])

    def slots_of(self, master: ClusterNode) -> list[tuple[int, int]]:
        """The slot ranges `master` serves, as it says itself."""
        return [(s, e) for s, e, port, _ in master.slot_map() or [] if port == master.port]

    # --- data ------------------------------------------------------------------------------------

    def flushall(self, timeout: float = 10.0) -> None:
        """FLUSHALL on every master, then wait until each replica has applied it."""
        masters = self.masters()
        for m in masters:
            m.call("FLUSHALL")
        for m in masters:
            self.wait_replicated(m, timeout)

    def wait_replicated(self, master: ClusterNode, timeout: float = 5.0) -> None:
        """Until master's replica has processed every byte of its replication stream."""
        replica = self.replica_of(master)

        def caught_up() -> bool:
            if replica.info("master_link_status", "replication") != "up":
                return False
            offset = master.info("master_repl_offset", "replication")
            return offset is not None and replica.info("slave_repl_offset", "replication") == offset

        self._wait(caught_up, timeout, f"{replica} to catch up with {master}")

    # --- failover --------------------------------------------------------------------------------

    def kill_master_and_promote(self, master: ClusterNode, timeout: float = 30.0) -> ClusterNode:
        """Pause writes on `master`, wait until its replica has them all, SIGKILL it, and wait until
        the replica is master of its slots in every live node's view. Returns the promoted node."""
        replica = self.replica_of(master)
        slots = self.slots_of(master)
        if not slots:
            raise RuntimeError(f"{master} serves no slots")
        master.call("CLIENT", "PAUSE", int(timeout * 1000), "WRITE")
        try:
            self.wait_replicated(master, timeout)
        except BaseException:
            master.call("CLIENT", "UNPAUSE")
            raise
        master.stop(kill=True)

        def promoted() -> bool:
            if replica.role() != "master":
                return False
            for n in self.live():
                if n.cluster_info().get("cluster_state") != "ok":
                    return False
                view = n.slot_map() or []
                owners = {port for s, e, port, _ in view for a, b in slots if s <= b and a <= e}
                if owners != {replica.port} or len(_covered(view)) != N_SLOTS:
                    return False
            return True

        self._wait(promoted, timeout, f"{replica} to take over the slots of {master}")
        return replica

    def restart_as_replica(self, node: ClusterNode, timeout: float = 30.0) -> ClusterNode:
        """Restart a killed node on its port and folder; it rejoins from its nodes.conf and, its slots
        now owned by a newer epoch, becomes the replica of their new master. Waits until it is in sync
        and no live node flags it as failing."""
        node.start()
        node_id = node.node_id()

        def rejoined() -> bool:
            if node.role() != "slave" or node.info("master_link_status", "replication") != "up":
                return False
            for n in self.live():
                if n.cluster_info().get("cluster_state") != "ok":
                    return False
                try:
                    nodes = n.call("CLUSTER", "NODES")
                except (redis.ConnectionError, redis.TimeoutError):
                    return False
                line = next((x for x in nodes.splitlines() if x.startswith(node_id)), "")
                flags = line.split()[2].split(",") if line else ["?"]
                if "slave" not in flags or "fail" in flags or "fail?" in flags:
                    return False
            return True

        self._wait(rejoined, timeout, f"{node} to rejoin as a replica")
        return node

    # --- resharding ------------------------------------------------------------------------------

    def migrate_slot(
        self,
        slot: int,
        target: ClusterNode,
        *,
        batch: int = 10,
        between: Callable[[], Any] | None = None,
        timeout: float = 30.0,
    ) -> int:
        """Move one slot to master `target` the way redis-cli resharding does (IMPORTING, MIGRATING,
        MIGRATE keys in batches, SETSLOT NODE everywhere) and wait until every live node agrees.
        `between()` runs after each batch (and once if the slot holds no keys) while the slot is
        still half-moved, so clients see ASK and TRYAGAIN. Returns the number of keys moved."""
        source = self.master_of_slot(slot)
        if source is target:
            raise ValueError(f"slot {slot} is already on {target}")
        source_id, target_id = source.node_id(), target.node_id()
        target.call("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        source.call("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        moved, called = 0, False
        while True:
            keys = source.call("CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                if between is None or called:
                    break
            else:
                reply = source.call("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
                if reply not in ("OK", "NOKEY"):
                    raise RuntimeError(f"MIGRATE of slot {slot} answered {reply!r}\n{self.logs()}")
                moved += len(keys)
            if between is not None:
                between()
                called = True
        target.call("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        source.call("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        for m in self.masters():
            if m is not source and m is not target:
                m.call("CLUSTER", "SETSLOT", slot, "NODE", target_id)

        def agreed() -> bool:
            maps = [n.slot_map() for n in self.live()]
            if any(m is None for m in maps) or any(m != maps[0] for m in maps):
                return False
            return any(s <= slot <= e and port == target.port for s, e, port, _ in maps[0])

        self._wait(agreed, timeout, f"every node to give slot {slot} to {target}")
        return moved

    # --- health and logs -------------------------------------------------------------------------

    def _healthy(self) -> bool:
        """Every node up, cluster ok, all slots served, each replica in sync, every view the same."""
        maps = []
        for n in self.nodes:
            info = n.cluster_info()
            if (
                info.get("cluster_state") != "ok"
                or info.get("cluster_slots_ok") != str(N_SLOTS)
                or info.get("cluster_known_nodes") != str(len(self.nodes))
                or info.get("cluster_size") != str(self.n_masters)
            ):
                return False
            role = n.role()
            if role == "slave" and n.info("master_link_status", "replication") != "up":
                return False
            maps.append(n.slot_map())
        if any(m != maps[0] for m in maps) or len(_covered(maps[0] or [])) != N_SLOTS:
            return False
        # every master has exactly one replica in the shared view
        return all(len(r) == 1 for *_, r in maps[0])

    def log(self, node: ClusterNode, chars: int = 3000) -> str:
        return node.log(chars)

    def logs(self, chars: int = 1500) -> str:
        """The tail of every node's redis.log, for assertion messages."""
        return "\n".join(f"--- {n} ({'up' if n.running else 'down'}) ---\n{n.log(chars)}" for n in self.nodes)

    def _any_master(self) -> ClusterNode:
        for n in self.live():
            if n.role() == "master":
                return n
        raise RuntimeError(f"no live master\n{self.logs()}")

    def _wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(POLL)
        state = "\n".join(f"{n}: {n.role()} {n.cluster_info().get('cluster_state')}" for n in self.nodes)
        raise RuntimeError(f"timed out after {timeout}s waiting for {what}\n{state}\n{self.logs()}")


def _covered(slot_map: SlotMap) -> set[int]:
    return {s for start, end, *_ in slot_map for s in range(start, end + 1)}


def _free_port_except(taken: set[int]) -> int:
    while True:
        port = free_port()
        if port not in taken:
            return port
