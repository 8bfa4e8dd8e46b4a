"""Per-component secrets: generate them, hash passwords (bcrypt), store them, rotate them.

An auth directory (mode 0700) holds:

    users.json          the registry: per user its role, jobs, machine, kind, and the bcrypt
                        hash or NKey public key -- no plaintext, so the server config can be
                        rendered (and re-rendered after a rotation) from it alone
    creds/<name>.json   each component's credentials file (mode 0600): what that component
                        is given (TRAINMOVER_NATS_CREDS), and nothing of anyone else's

Existing secrets are kept when the directory is reused, so credentials handed out stay
valid across `trainmover up` restarts; `rotate` replaces one component's secret.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainmover.security.policy import Component

AuthKind = Literal["password", "nkey"]
AUTH_KINDS: tuple[AuthKind, ...] = ("password", "nkey")

BCRYPT_ROUNDS = 10
"""bcrypt cost of the stored password hashes. The server checks the hash on every
connect, so the cost is paid per (re)connection (cost 10: ~0.5 s of one slow core);
tests use the minimum, 4."""


class SecretsError(ValueError):
    """An auth directory that cannot be read or written; str() is one line."""


@dataclass(frozen=True)
class UserRecord:
    """What the server needs to know about one user: never the secret itself."""

    component: Component
    kind: AuthKind
    password_hash: str | None = None
    nkey_public: str | None = None

    @property
    def name(self) -> str:
        return self.component.name

    def to_json(self) -> dict[str, Any]:
        c = self.component
        return {
            "role": c.role,
            "jobs": list(c.jobs),
            "machine": c.machine,
            "kind": self.kind,
            "password_hash": self.password_hash,
            "nkey_public": self.nkey_public,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UserRecord:
        component = Component(data["role"], tuple(data["jobs"]), data.get("machine"))
        return cls(component, data["kind"], data.get("password_hash"), data.get("nkey_public"))


@dataclass(frozen=True)
class ClientTls:
    """TLS settings written into every credentials file (paths as given)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


def new_password() -> str:
    """A fresh random password (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def hash_password(password: str, rounds: int = BCRYPT_ROUNDS) -> str:
    """The bcrypt hash nats-server accepts in place of a plaintext password ($2a$...)."""
    import bcrypt

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds, prefix=b"2a")).decode()


def new_nkey() -> tuple[str, str]:
    """A fresh NKey user (seed, public key)."""
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
    public = nkeys.from_seed(bytearray(seed.encode())).public_key.decode()
    return seed, public


def write_private(path: Path, text: str) -> None:
    """Writes `text` readable by the owner only, atomically (a reader never sees half)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)  # umask cannot widen it, but an old tmp file might be wider
    tmp.replace(path)


class AuthStore:
    """One auth directory: the registry and the credentials files."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.registry_path = self.root / "users.json"
        self.creds_dir = self.root / "creds"

    def creds_file(self, component: Component | str) -> Path:
        name = component if isinstance(component, str) else component.name
        return self.creds_dir / f"{name}.json"

    def load(self) -> dict[str, UserRecord]:
        """The registry (empty for a new directory)."""
        if not self.registry_path.exists():
            return {}
        try:
            data = json.loads(self.registry_path.read_text())
            return {name: UserRecord.from_json(entry) for name, entry in data["users"].items()}
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SecretsError(f"auth registry {self.registry_path}: {err}") from None

    def _save(self, records: dict[str, UserRecord]) -> None:
        body = {"users": {name: records[name].to_json() for name in sorted(records)}}
        write_private(self.registry_path, json.dumps(body, indent=2) + "\n")

    def ensure(
        self,
        components: Iterable[Component],
        kind: AuthKind = "password",
        tls: ClientTls | None = None,
        rounds: int = BCRYPT_ROUNDS,
    ) -> list[UserRecord]:
        """Records (and credentials files) for `components`, creating what is missing.

        A user already in the registry keeps its secret; its role, jobs and machine are
        updated (adding a job to a service widens its permissions, not its secret).
        """
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        records = self.load()
        out = []
        for component in components:
            old = records.get(component.name)
            if old is not None and old.kind == kind and self.creds_file(component).exists():
                record = UserRecord(component, kind, old.password_hash, old.nkey_public)
                self._write_creds(component, None, tls)  # refresh TLS paths, keep the secret
            else:
                record = self._issue(component, kind, tls, rounds)
            records[component.name] = record
            out.append(record)
        self._save(records)
        return out

    def rotate(
        self, name: str, tls: ClientTls | None = None, rounds: int = BCRYPT_ROUNDS
    ) -> UserRecord:
        """Replaces user `name`'s secret; the old one stops working at the server's next
        config reload."""
        records = self.load()
        if name not in records:
            raise SecretsError(f"no user {name!r} in {self.registry_path}")
        old = records[name]
        if tls is None:
            tls = self._old_tls(name)
        records[name] = self._issue(old.component, old.kind, tls, rounds)
        self._save(records)
        return records[name]

    def _old_tls(self, name: str) -> ClientTls | None:
        try:
            current = json.loads(self.creds_file(name).read_text())
        except (OSError, ValueError):
            return None
        tls = ClientTls(current.get("tls_ca"), current.get("tls_cert"), current.get("tls_key"))
        return tls if (tls.ca or tls.cert) else None

    def _issue(
        self, component: Component, kind: AuthKind, tls: ClientTls | None, rounds: int
    ) -> UserRecord:
        if kind == "password":
            password = new_password()
            self._write_creds(component, {"user": component.name, "password": password}, tls)
            return UserRecord(component, kind, password_hash=hash_password(password, rounds))
        seed, public = new_nkey()
        self._write_creds(component, {"nkey_seed": seed}, tls)
        return UserRecord(component, kind, nkey_public=public)

    def _write_creds(
        self, component: Component, secret: dict[str, str] | None, tls: ClientTls | None
    ) -> None:
        path = self.creds_file(component)
        if secret is None:
            try:
                current = json.loads(path.read_text())
            except (OSError, ValueError) as err:
                raise SecretsError(f"credentials file {path}: {err}") from None
            secret = {k: current[k] for k in ("user", "password", "nkey_seed") if k in current}
        body: dict[str, str] = {
            "name": component.name,
            "role": component.role,
            **secret,
            "inbox_prefix": component.inbox_prefix,
        }
        if tls is not None:
            body.update({f"tls_{k}": os.path.abspath(v) for k, v in vars(tls).items() if v})
        write_private(path, json.dumps(body, indent=2) + "\n")
