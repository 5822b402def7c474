"""What `bmdb.localha`'s processes are told: each Patroni member's
configuration and HAProxy's, as pure functions of ports, timings and
passwords (see `bmdb.localha` for why the proxy and these settings)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SCOPE", "Member", "haproxy_config", "patroni_config"]

#: The cluster's name in Patroni (its key prefix in etcd).
SCOPE = "bmdb"

#: Seconds between two health checks of a member by the proxy; after
#: `_CHECK_FALL` failed ones in a row it routes nothing to it and cuts the
#: sessions it has open there.
_CHECK_INTERVAL = 0.3
_CHECK_FALL = 2


@dataclass
class Member:
    """One Patroni member: its name, PostgreSQL port and REST API port."""

    name: str
    pg_port: int
    api_port: int
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def config(self) -> Path:
        return self.root / "patroni.yml"

    @property
    def log_path(self) -> Path:
        return self.root / "patroni.log"


def haproxy_config(proxy_port: int, standby_proxy_port: int, members: Sequence[Member]) -> str:
    """HAProxy's configuration: a TCP listener per target, each member a
    server checked on its REST API (Patroni's recommended template)."""
    lines = [
        "global",
        "    maxconn 4000",
        "defaults",
        "    mode tcp",
        "    timeout connect 2s",
        # Pooled connections sit idle between transactions.
        "    timeout client 1h",
        "    timeout server 1h",
        "    timeout check 1s",
    ]
    for name, port, check in (
        ("primary", proxy_port, "/primary"),
        ("replicas", standby_proxy_port, "/replica"),
    ):
        interval = f"{int(_CHECK_INTERVAL * 1000)}ms"
        lines += [
            f"listen {name}",
            f"    bind 127.0.0.1:{port}",
            "    option httpchk",
            f"    http-check send meth GET uri {check}",
            "    http-check expect status 200",
            f"    default-server inter {interval} fastinter {interval} downinter {interval}"
            f" rise 1 fall {_CHECK_FALL} on-marked-down shutdown-sessions",
        ]
        lines += [
            f"    server {m.name} 127.0.0.1:{m.pg_port} check port {m.api_port}" for m in members
        ]
    return "\n".join(lines) + "\n"


def patroni_config(
    member: Member,
    *,
    etcd_port: int,
    ttl: int,
    loop_wait: int,
    retry_timeout: int,
    bin_dir: Path,
    passwords: Mapping[str, str],
) -> dict[str, Any]:
    """Patroni's configuration of ``member`` (JSON is YAML: Patroni reads
    it as its configuration file): etcd3 as its store, the watchdog where
    the host has one, synchronous replication, ``pg_rewind``, and the roles'
    ``passwords`` (``postgres``, ``replicator``)."""
    return {
        "scope": SCOPE,
        "namespace": "/patroni/",
        "name": member.name,
        "log": {"level": "INFO", "dir": str(member.root), "file_num": 1},
        "restapi": {
            "listen": f"127.0.0.1:{member.api_port}",
            "connect_address": f"127.0.0.1:{member.api_port}",
        },
        "etcd3": {"hosts": [f"127.0.0.1:{etcd_port}"]},
        # Fencing where the host can: a watchdog that resets the machine
        # when Patroni stops feeding it. "automatic": used if the host
        # has /dev/watchdog, and Patroni runs on without one (the proxy
        # is then the fence, module docstring).
        "watchdog": {"mode": "automatic"},
        "bootstrap": {
            "dcs": {
                "ttl": ttl,
                "loop_wait": loop_wait,
                "retry_timeout": retry_timeout,
                "maximum_lag_on_failover": 1048576,
                # Fail over when the primary's postgres crashes, rather
                # than restart it in place and keep clients waiting.
                "master_start_timeout": 0,
                "synchronous_mode": True,
                "postgresql": {
                    "use_pg_rewind": True,
                    "use_slots": True,
                    "remove_data_directory_on_rewind_failure": True,
                    "remove_data_directory_on_diverged_timelines": True,
                    "parameters": {
                        "max_connections": 300,
                        "shared_buffers": "64MB",
                        "fsync": "off",
                        # pg_rewind needs full pages and hint bits in WAL.
                        "wal_log_hints": "on",
                        "wal_keep_size": "128MB",
                        "max_wal_senders": 10,
                        "max_replication_slots": 10,
                        "hot_standby": "on",
                    },
                },
            },
            "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
        },
        "postgresql": {
            "listen": f"127.0.0.1:{member.pg_port}",
            "connect_address": f"127.0.0.1:{member.pg_port}",
            "data_dir": str(member.data),
            "bin_dir": str(bin_dir),
            "pgpass": str(member.root / "pgpass"),
            "authentication": {
                "superuser": {"username": "postgres", "password": passwords["postgres"]},
                "replication": {
                    "username": "replicator",
                    "password": passwords["replicator"],
                },
            },
            "parameters": {"unix_socket_directories": str(member.root)},
            "pg_hba": [
                "local all all peer",
                "host replication replicator 127.0.0.1/32 scram-sha-256",
                "host all all 127.0.0.1/32 scram-sha-256",
            ],
        },
    }
