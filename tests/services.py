"""Throwaway PostgreSQL and Redis servers, so that tests and the chaos run never touch the machine's.

A test that restarts, stops or kills its database or broker does it to a server of its own:
`ThrowawayPostgres` runs `initdb` into a temporary folder and `pg_ctl` on a free port (trust auth,
127.0.0.1 only, no fsync), `ThrowawayRedis` runs `redis-server` on a free port with nothing persisted.
Each server lives in a folder holding a marker file; another process handed the folder (`attach`,
or `from_env` through THROWAWAY_POSTGRES / THROWAWAY_REDIS) can restart it. Every action checks
first that the folder is one this module made and, for Redis, that the server answering on the port
was started from that folder's configuration; anything else raises `Refused`.

    python -m tests.services [--sets N] [--] COMMAND ...

runs COMMAND with DATABASE_URL and CELERY_BROKER_URL pointing at fresh servers (and their folders
in THROWAWAY_POSTGRES / THROWAWAY_REDIS), then removes them; `make test` runs pytest this way.
With `--sets N` it starts N pairs, one for each of N pytest-xdist workers (THROWAWAY_SETS lists
them; tests/xdist_services.py hands each worker its own), so that a test restarting its database
or broker never pulls them from under a test running on another worker.

initdb and pg_ctl refuse to run as root: as root they run as the `postgres` user (runuser), which
then owns the folder.
"""

from __future__ import annotations

import getpass
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARKER = "throwaway-service.json"
POSTGRES_ENV, REDIS_ENV, RABBIT_ENV = "THROWAWAY_POSTGRES", "THROWAWAY_REDIS", "THROWAWAY_RABBITMQ"
SETS_ENV = "THROWAWAY_SETS"


class Refused(RuntimeError):
    """The service is not one this module started: it is left alone."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(predicate, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


class _Throwaway:
    kind = ""

    def __init__(self, folder: Path, port: int):
        self.folder, self.port = folder, port

    @classmethod
    def _make_folder(cls) -> tuple[Path, int]:
        folder = Path(tempfile.mkdtemp(prefix=f"throwaway-{cls.kind}-"))
        port = free_port()
        (folder / MARKER).write_text(json.dumps({"kind": cls.kind, "port": port, "created_by": os.getpid()}))
        return folder, port

    @classmethod
    def attach(cls, folder: str | Path):
        """A handle on a server another process created; refuses a folder this module did not make."""
        marker = Path(folder) / MARKER
        try:
            meta = json.loads(marker.read_text())
        except (OSError, ValueError) as exc:
            raise Refused(f"{folder} is not a throwaway {cls.kind} folder (no {MARKER})") from exc
        if meta.get("kind") != cls.kind:
            raise Refused(f"{folder} holds a throwaway {meta.get('kind')}, not {cls.kind}")
        return cls(Path(folder), int(meta["port"]))

    @classmethod
    def from_env(cls):
        folder = os.environ.get(cls.env_name)
        if not folder:
            raise Refused(f"{cls.env_name} is not set: this process started no throwaway {cls.kind}")
        return cls.attach(folder)

    def _check(self) -> None:
        if not (self.folder / MARKER).exists():
            raise Refused(f"{self.folder} is not a throwaway {self.kind} folder any more")

    def restart(self) -> None:
        self.stop()
        self.start()

    def destroy(self) -> None:
        """Stop the server (as a crash would, nothing to save) and remove its folder."""
        if (self.folder / MARKER).exists():
            self.kill()
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


class ThrowawayPostgres(_Throwaway):
    """A PostgreSQL cluster in a temporary folder, served on 127.0.0.1:<free port>."""

    kind = "postgres"
    env_name = POSTGRES_ENV

    def __init__(self, folder: Path, port: int):
        super().__init__(folder, port)
        self.data = folder / "data"
        self.user = json.loads((folder / MARKER).read_text()).get("superuser", "postgres")

    @staticmethod
    def binaries() -> Path:
        found = sorted(
            Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name)
        )
        if found:
            return found[-1].parent
        pg_ctl = shutil.which("pg_ctl")
        if not pg_ctl:
            raise RuntimeError("PostgreSQL server binaries (initdb, pg_ctl) not found")
        return Path(pg_ctl).parent

    @staticmethod
    def _as_owner(args: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args

    def _pg(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            self._as_owner([str(self.binaries() / tool), *args]),
            capture_output=True,
            text=True,
            check=check,
            cwd=self.folder,
        )

    @classmethod
    def create(cls) -> ThrowawayPostgres:
        """initdb a new cluster (not started); its superuser has this process's user name, trust auth."""
        folder, port = cls._make_folder()
        superuser = getpass.getuser()
        meta = json.loads((folder / MARKER).read_text())
        (folder / MARKER).write_text(json.dumps({**meta, "superuser": superuser}))
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(folder, owner.pw_uid, owner.pw_gid)
        self = cls(folder, port)
        try:
            self._pg(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                superuser,
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
            )
        except subprocess.CalledProcessError as exc:
            shutil.rmtree(folder, ignore_errors=True)
            raise RuntimeError(f"initdb failed: {exc.stderr}") from exc
        settings = {
            "port": port,
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": "''",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": 300,
            "shared_buffers": "'64MB'",
            "log_min_messages": "warning",
        }
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write("\n# throwaway cluster (tests/services.py)\n")
            conf.writelines(f"{name} = {value}\n" for name, value in settings.items())
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgres://{self.user}@127.0.0.1:{self.port}/{database}"

    @property
    def running(self) -> bool:
        return self._pg("pg_ctl", "-D", str(self.data), "status", check=False).returncode == 0

    def start(self) -> None:
        self._check()
        self._pg(
            "pg_ctl", "-D", str(self.data), "-l", str(self.folder / "postgres.log"), "-w", "-t", "60", "start"
        )

    def stop(self) -> None:
        """A clean shutdown: sessions are disconnected (`-m fast`)."""
        self._check()
        self._pg("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    def restart(self) -> None:
        self._check()
        self._pg(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.folder / "postgres.log"),
            "-m",
            "fast",
            "-w",
            "-t",
            "60",
            "restart",
        )

    def kill(self) -> None:
        """Stop as a crash would: no shutdown checkpoint, crash recovery at the next start."""
        self._check()
        if self.running:
            self._pg("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "60", "stop")

    def create_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.url().replace("postgres://", "postgresql://", 1), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

    def start_time(self) -> str:
        """pg_postmaster_start_time(): changes on every restart."""
        return postmaster_start_time(self.url())


class ThrowawayRedis(_Throwaway):
    """A redis-server on 127.0.0.1:<free port> configured from its folder, persisting nothing."""

    kind = "redis"
    env_name = REDIS_ENV

    @property
    def config(self) -> Path:
        return self.folder / "redis.conf"

    @property
    def pidfile(self) -> Path:
        return self.folder / "redis.pid"

    @classmethod
    def create(cls) -> ThrowawayRedis:
        folder, port = cls._make_folder()
        self = cls(folder, port)
        self.config.write_text(
            "\n".join(
                [
                    f"port {port}",
                    "bind 127.0.0.1",
                    'save ""',
                    "appendonly no",
                    f"dir {folder}",
                    "daemonize yes",
                    f"pidfile {self.pidfile}",
                    f"logfile {folder / 'redis.log'}",
                    "loglevel warning",
                    "",
                ]
            )
        )
        return self

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _client(self):
        return _redis_client(self.port)

    def info(self) -> dict | None:
        """INFO server of whatever answers on the port, or None when nothing does."""
        import redis

        try:
            return self._client().info("server")
        except redis.ConnectionError:
            return None

    def _ours(self) -> int | None:
        """The pid of our server if it is the one answering on the port; refuses a stranger."""
        info = self.info()
        if info is None:
            return None
        if Path(str(info.get("config_file", ""))).resolve() != self.config.resolve():
            raise Refused(f"the Redis on port {self.port} was not started from {self.config}: left alone")
        return int(info["process_id"])

    @property
    def running(self) -> bool:
        return self._ours() is not None

    def start(self) -> None:
        self._check()
        if self._ours() is not None:
            return
        subprocess.run(["redis-server", str(self.config)], check=True, capture_output=True)
        _wait(lambda: self._ours() is not None, timeout=15, what=f"redis on port {self.port}")

    def _gone(self, pid: int) -> bool:
        return _gone(pid)

    def stop(self) -> None:
        """SHUTDOWN NOSAVE: every queued message is lost, as when an unpersisted broker restarts."""
        self._check()
        pid = self._ours()
        if pid is None:
            return
        import redis

        try:
            self._client().shutdown(nosave=True)
        except redis.ConnectionError:
            pass  # the server closes the connection as it exits
        _wait(lambda: self._gone(pid) and self.info() is None, timeout=15, what=f"redis {pid} to exit")

    def kill(self) -> None:
        self._check()
        pid = self._ours()
        if pid is None:
            return
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: self._gone(pid), timeout=15, what=f"redis {pid} to exit")

    def run_id(self) -> str:
        return str((self.info() or {}).get("run_id", ""))


class ThrowawayRabbit(_Throwaway):
    """A RabbitMQ node of its own (`rabbit-<port>@localhost`) on 127.0.0.1:<free port>, its data in
    its folder: queues and messages survive its restarts as they would in production (quorum
    queues are written to disk before a publish is confirmed). It shares the machine's epmd (the
    Erlang port mapper) and nothing else; the machine's RabbitMQ on 5672 is never touched."""

    kind = "rabbitmq"
    env_name = RABBIT_ENV
    BIN = Path("/usr/lib/rabbitmq/bin")

    @classmethod
    def create(cls) -> ThrowawayRabbit:
        folder, port = cls._make_folder()
        meta = json.loads((folder / MARKER).read_text())
        meta["dist_port"] = free_port()
        (folder / MARKER).write_text(json.dumps(meta))
        (folder / "enabled_plugins").write_text("[].\n")
        (folder / "rabbitmq.conf").write_text(
            "\n".join(["loopback_users = none", "log.console = false", "log.file.level = warning", ""])
        )
        return cls(folder, port)

    @property
    def node(self) -> str:
        return f"rabbit-{self.port}@localhost"

    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def _env(self) -> dict[str, str]:
        dist = json.loads((self.folder / MARKER).read_text())["dist_port"]
        return dict(
            os.environ,
            HOME=str(self.folder),  # the Erlang cookie is made there, not in the machine's node's home
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(dist),
            RABBITMQ_MNESIA_BASE=str(self.folder / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.folder / "log"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.folder / "enabled_plugins"),
            RABBITMQ_CONFIG_FILE=str(self.folder / "rabbitmq"),
            RABBITMQ_PID_FILE=str(self.folder / "rabbit.pid"),
            ERL_EPMD_ADDRESS="127.0.0.1",
        )

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"AMQP\x00\x00\x09\x01")
                return sock.recv(1)[:1] == b"\x01"  # Connection.Start: the broker is taking clients
        except OSError:
            return False

    def _pid(self) -> int | None:
        try:
            return int((self.folder / "rabbit.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    @property
    def running(self) -> bool:
        pid = self._pid()
        return pid is not None and not _gone(pid) and self._answers()

    def start(self) -> None:
        self._check()
        if self.running:
            return
        (self.folder / "log").mkdir(exist_ok=True)
        with (self.folder / "log" / "server.out").open("ab") as out:
            subprocess.Popen(
                [str(self.BIN / "rabbitmq-server")],
                env=self._env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _wait(self._answers, timeout=90, what=f"rabbitmq on port {self.port}")

    def stop(self) -> None:
        """A clean stop: quorum queues keep their messages for the next start."""
        self._check()
        pid = self._pid()
        if pid is None or _gone(pid):
            return
        subprocess.run(
            [str(self.BIN / "rabbitmqctl"), "-n", self.node, "stop"],
            env=self._env(),
            capture_output=True,
            timeout=60,
        )
        _wait(lambda: _gone(pid) and not self._answers(), timeout=60, what=f"rabbitmq {pid} to exit")

    def kill(self) -> None:
        self._check()
        pid = self._pid()
        if pid is None or _gone(pid):
            return
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: _gone(pid), timeout=15, what=f"rabbitmq {pid} to exit")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _redis_client(port: int):
    """A client that answers at once: no retries with backoff on a refused connection (redis-py's default)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=5, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0)
    )


# --- the machine's own services: read, never touched ---------------------------------------------


def postmaster_start_time(url: str) -> str:
    import psycopg

    with psycopg.connect(url.replace("postgres://", "postgresql://", 1), connect_timeout=3) as conn:
        return str(conn.execute("SELECT pg_postmaster_start_time()").fetchone()[0])


def machine_services(postgres_port: int = 5432, redis_port: int = 6379) -> dict[str, str | None]:
    """Identity of the machine's PostgreSQL and Redis (None when down or unreachable): a restart changes it."""
    import psycopg
    import redis

    seen: dict[str, str | None] = {"postgres": None, "redis": None}
    try:
        seen["postgres"] = postmaster_start_time(
            f"postgres://{getpass.getuser()}@127.0.0.1:{postgres_port}/postgres"
        )
    except psycopg.Error:
        pass
    try:
        info = _redis_client(redis_port).info("server")
        seen["redis"] = f"pid {info['process_id']} run_id {info['run_id']}"
    except redis.RedisError:
        pass
    return seen


# --- python -m tests.services COMMAND ------------------------------------------------------------


def _parse(argv: list[str]) -> tuple[int, str, list[str]]:
    """`[--sets N] [--broker redis|rabbitmq] [--] COMMAND ...`: N sets of servers (one per
    pytest-xdist worker), default 1; with `--broker rabbitmq` each set adds a RabbitMQ node of its
    own as the Celery broker (Redis stays, as the cache and the quota counters)."""
    sets, broker = 1, "redis"
    while argv[:1] in (["--sets"], ["--broker"]):
        if argv[0] == "--sets":
            sets = max(int(argv[1]), 1)
        else:
            broker = argv[1]
            if broker not in ("redis", "rabbitmq"):
                raise SystemExit(f"--broker must be redis or rabbitmq, not {broker!r}")
        argv = argv[2:]
    return sets, broker, (argv[1:] if argv[:1] == ["--"] else argv)


def _environment(
    postgres: ThrowawayPostgres, redis_server: ThrowawayRedis, rabbit: ThrowawayRabbit | None
) -> dict[str, str]:
    env = {
        "DATABASE_URL": postgres.url("test"),
        "CELERY_BROKER_URL": redis_server.url(15),
        POSTGRES_ENV: str(postgres.folder),
        REDIS_ENV: str(redis_server.folder),
    }
    if rabbit is not None:
        env.update(
            CELERY_BROKER_URL=rabbit.url(),
            CACHE_URL=redis_server.url(14),
            QUOTA_REDIS_URL=redis_server.url(15),
            **{RABBIT_ENV: str(rabbit.folder)},
        )
    return env


def main(argv: list[str]) -> int:
    sets, broker_kind, command = _parse(argv)
    if not command:
        print(__doc__, file=sys.stderr)
        return 2
    servers: list[_Throwaway] = []
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    child: subprocess.Popen | None = None
    try:
        environments = []
        for _ in range(sets):
            postgres, broker = ThrowawayPostgres.create(), ThrowawayRedis.create()
            rabbit = ThrowawayRabbit.create() if broker_kind == "rabbitmq" else None
            servers += [postgres, broker, *([rabbit] if rabbit else [])]
            postgres.start()
            broker.start()
            if rabbit is not None:
                rabbit.start()
            postgres.create_database("test")
            environments.append(_environment(postgres, broker, rabbit))
            print(
                f"throwaway PostgreSQL on port {postgres.port}, Redis on port {broker.port}"
                + (f", RabbitMQ on port {rabbit.port}" if rabbit else ""),
                file=sys.stderr,
                flush=True,
            )
        # The first pair is the command's own; all pairs go in SETS_ENV for the pytest-xdist
        # workers, each of which takes one (tests/xdist_services.py).
        env = dict(os.environ, **environments[0], **{SETS_ENV: json.dumps(environments)})
        child = subprocess.Popen(command, env=env)
        return child.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
        signal.signal(signal.SIGTERM, previous)
        for server in servers:
            server.destroy()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
