"""A Sentinel-managed Redis for the tests: a primary and a replica (AOF on both) and 1 or 3 Sentinels,
every one a real redis-server process on a free port (`redis-server <conf> --sentinel`)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from worker.service.redis_proc import RedisProcess, free_port

SERVICE = "mymaster"
# A primary that has not answered a PING for this long is down. Not less: a new primary busy with a
# burst of writes (fsync on each) on a loaded machine can take over a second to answer one, and
# Sentinel would then fail over again.
DOWN_AFTER_MS = 2000


class SentinelProcess:
    """One Sentinel; it rewrites its config file, so that file lives in its own folder."""

    def __init__(
        self,
        folder: Path,
        primary_port: int,
        *,
        quorum: int,
        service: str = SERVICE,
        password: str | None = None,
        auth_pass: str | None = None,
        down_after_ms: int = DOWN_AFTER_MS,
    ) -> None:
        self.port = free_port()
        self.folder = folder
        self.password = password
        self.conf = folder / "sentinel.conf"
        self.conf.write_text(
            "\n".join(
                [
                    f"port {self.port}",
                    "bind 127.0.0.1",
                    "daemonize no",
                    f"dir {folder}",
                    f"logfile {folder / 'sentinel.log'}",
                    f"sentinel monitor {service} 127.0.0.1 {primary_port} {quorum}",
                    f"sentinel down-after-milliseconds {service} {down_after_ms}",
                    f"sentinel failover-timeout {service} 5000",
                    *([f"sentinel auth-pass {service} {auth_pass}"] if auth_pass else []),
                    *([f"requirepass {password}"] if password else []),
                    "",
                ]
            )
        )
        self.proc: subprocess.Popen | None = None

    def start(self) -> SentinelProcess:
        binary = shutil.which("redis-server") or "redis-server"
        self.proc = subprocess.Popen([binary, str(self.conf), "--sentinel"], stdout=subprocess.DEVNULL)
        client = self.client()
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"sentinel exited with {self.proc.returncode}: {self.log()}")
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    time.sleep(0.02)
        finally:
            client.close()
        raise RuntimeError(f"sentinel on port {self.port} did not start: {self.log()}")

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, socket_timeout=5, decode_responses=True)

    def log(self) -> str:
        path = self.folder / "sentinel.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class SentinelGroup:
    """Primary + replica + Sentinels; `url` is the redis+sentinel:// URL of the service. With
    `password` the data nodes require it (and replicate with it), with `sentinel_password` the
    Sentinels require theirs."""

    def __init__(
        self,
        sentinels: int = 1,
        service: str = SERVICE,
        node_args: tuple[str, ...] = (),
        password: str | None = None,
        sentinel_password: str | None = None,
    ) -> None:
        self.service = service
        self.password, self.sentinel_password = password, sentinel_password
        self._secured = False
        # No 5 s wait before a full sync (the default): a replica is in sync at once.
        self.node_args = ("--repl-diskless-sync-delay", "0", *node_args)
        self.n_sentinels = sentinels
        self.folder = Path(tempfile.mkdtemp(prefix="pagedq-sentinel-"))
        self.nodes: list[RedisProcess] = []
        self.sentinels: list[SentinelProcess] = []

    def start(self) -> SentinelGroup:
        primary = RedisProcess(appendonly=True, extra_args=list(self.node_args)).start()
        self.nodes.append(primary)
        follow = ["--replicaof", "127.0.0.1", str(primary.port)]
        replica = RedisProcess(appendonly=True, extra_args=[*self.node_args, *follow])
        self.nodes.append(replica.start())
        _wait(lambda: self.info(replica, "master_link_status") == "up", 10, "the replica to sync")
        if self.password:  # set once in sync (RedisProcess checks a start with a bare PING)
            for node in self.nodes:
                c = redis.Redis(port=node.port, socket_timeout=5)
                c.config_set("masterauth", self.password)
                c.config_set("requirepass", self.password)
                c.close()
            self._secured = True
        quorum = self.n_sentinels // 2 + 1
        for i in range(self.n_sentinels):
            folder = self.folder / f"sentinel-{i}"
            folder.mkdir()
            sentinel = SentinelProcess(
                folder,
                primary.port,
                quorum=quorum,
                service=self.service,
                password=self.sentinel_password,
                auth_pass=self.password,
            )
            self.sentinels.append(sentinel.start())
        _wait(self._ready, 20, "the Sentinels to see the replica and each other")
        return self

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        creds = f":{self.password}@" if self.password else ""
        query = f"?sentinel_password={self.sentinel_password}" if self.sentinel_password else ""
        return f"redis+sentinel://{creds}{hosts}/{self.service}/0{query}"

    def admin(self, node: RedisProcess) -> redis.Redis:
        """A plain client of one data node."""
        return redis.Redis(port=node.port, password=self.password if self._secured else None, socket_timeout=5)

    def primary(self) -> RedisProcess:
        """The node the Sentinels name as primary now."""
        port = self.primary_port()
        return next(n for n in self.nodes if n.port == port)

    def replica(self) -> RedisProcess:
        port = self.primary_port()
        return next(n for n in self.nodes if n.port != port)

    def primary_port(self) -> int:
        c = self.sentinels[0].client()
        try:
            return int(c.sentinel_get_master_addr_by_name(self.service)[1])
        finally:
            c.close()

    def _ready(self) -> bool:
        for s in self.sentinels:
            c = s.client()
            try:
                state = c.sentinel_master(self.service)
                replicas = c.sentinel_slaves(self.service)
            finally:
                c.close()
            if state["num-other-sentinels"] != self.n_sentinels - 1 or not replicas:
                return False
            if any(r["is_sdown"] or r["master-link-status"] != "ok" for r in replicas):
                return False
        return True

    def info(self, node: RedisProcess, field: str) -> str | None:
        """A field of the node's INFO replication (None while it is down)."""
        c = self.admin(node)
        try:
            value = c.info("replication").get(field)
            return value.decode() if isinstance(value, bytes) else value
        except redis.ConnectionError:
            return None
        finally:
            c.close()

    def cleanup(self) -> None:
        for s in self.sentinels:
            s.stop()
        for n in self.nodes:
            n.cleanup()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
