"""A PostgreSQL cluster of a test's own: installed from the OS packages when missing, run by a non-root user in a
temporary folder on a free port of 127.0.0.1, with password (SCRAM) authentication; stopped, restarted, removed.

Nothing outside its folder is touched except, once per machine, ``apt-get install postgresql`` when no
``/usr/lib/postgresql/*/bin/initdb`` exists (Debian/Ubuntu, as root). A machine that has neither the binaries
nor root and apt gets :class:`PostgresUnavailable`, which the tests turn into a skip naming what is missing.
"""
from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from mlflow_server import free_port


class PostgresUnavailable(RuntimeError):
    """PostgreSQL is not installed and cannot be installed here (not root, or no apt-get)."""


def postgres_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<major>/bin`` holding ``initdb`` and ``pg_ctl``, or None."""
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    found = [folder for folder in found if (folder / "pg_ctl").exists()]
    return max(found, key=lambda folder: int(folder.parent.name)) if found else None


def install_postgres() -> Path:
    """The PostgreSQL binaries' folder, installing the ``postgresql`` package first when it is missing."""
    folder = postgres_bin_dir()
    if folder is not None:
        return folder
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise PostgresUnavailable("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb) and this "
                                  "is not root with apt-get; install it with: apt-get install -y postgresql")
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "postgresql"]):
        done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=900)
        if done.returncode != 0:
            raise PostgresUnavailable(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
    folder = postgres_bin_dir()
    if folder is None:
        raise PostgresUnavailable("apt-get install postgresql succeeded but no /usr/lib/postgresql/*/bin/initdb")
    return folder


class PostgresCluster:
    """``initdb`` + ``pg_ctl`` in a fresh temporary folder (PostgreSQL refuses to run as root: as root the cluster
    belongs to the ``postgres`` user the package creates). Superuser ``user`` with a random password."""

    def __init__(self, user: str = "mlflow"):
        self.bin_dir = install_postgres()
        self.user = user
        self.password = secrets.token_hex(12)
        self.port = free_port()
        self.owner = "postgres" if os.geteuid() == 0 else None
        self.folder = Path(tempfile.mkdtemp(prefix="msprobe-postgres-"))
        self.data_dir = self.folder / "data"
        if self.owner:
            os.chown(self.folder, pwd.getpwnam(self.owner).pw_uid, pwd.getpwnam(self.owner).pw_gid)
        password_file = self.folder / "password"
        password_file.write_text(self.password)
        if self.owner:
            os.chown(password_file, pwd.getpwnam(self.owner).pw_uid, -1)
        self._run("initdb", "-D", str(self.data_dir), "-U", user, "--pwfile", str(password_file),
                  "--auth-host=scram-sha-256", "--auth-local=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8")
        password_file.unlink()

    def _run(self, program: str, *args: str, timeout: float = 120) -> str:
        kwargs = {}
        if self.owner:
            account = pwd.getpwnam(self.owner)
            kwargs = dict(user=account.pw_uid, group=account.pw_gid, extra_groups=[])
        done = subprocess.run([str(self.bin_dir / program), *args], capture_output=True, text=True, cwd=self.folder,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"},
                              timeout=timeout, **kwargs)
        if done.returncode != 0:
            raise RuntimeError(f"{program} {' '.join(args)} failed ({done.returncode}): {done.stdout[-1500:]}"
                               f"{done.stderr[-1500:]}")
        return done.stdout

    def start(self) -> "PostgresCluster":
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.folder} -c fsync=off"
        self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(self.data_dir), "-l", str(self.folder / "log"),
                  "-o", options)
        return self

    def stop(self) -> None:
        """Fast shutdown: open connections are cut, as when the database host restarts."""
        if (self.data_dir / "postmaster.pid").exists():
            self._run("pg_ctl", "stop", "-w", "-m", "fast", "-D", str(self.data_dir))

    def restart(self, down_seconds: float = 0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()

    def create_database(self, name: str) -> str:
        """Creates database ``name``; returns its SQLAlchemy URI (``postgresql+psycopg://``, psycopg 3)."""
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user=self.user, password=self.password,
                             dbname="postgres", autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.uri(name)

    def uri(self, database: str) -> str:
        return f"postgresql+psycopg://{self.user}:{self.password}@127.0.0.1:{self.port}/{database}"

    def remove(self) -> None:
        """Stops the cluster (if running) and deletes its folder."""
        try:
            self.stop()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
