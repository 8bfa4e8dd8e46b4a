"""How a component gets its NATS credentials and TLS settings, and hands them to nats-py.

One helper for every `bus.connect` caller (CLI, client, services): `NatsAuth` resolves,
highest first, command-line flags (`add_arguments`), environment variables, then the
credentials file named by either:

    TRAINMOVER_NATS_CREDS           credentials file: ours (JSON, written by
                                    `trainmover auth generate`) or a NATS JWT .creds
    TRAINMOVER_NATS_USER            user name
    TRAINMOVER_NATS_PASSWORD        password (or TRAINMOVER_NATS_PASSWORD_FILE)
    TRAINMOVER_NATS_TOKEN           token (or TRAINMOVER_NATS_TOKEN_FILE)
    TRAINMOVER_NATS_NKEY_SEED_FILE  file holding an NKey user seed (SU...)
    TRAINMOVER_NATS_TLS_CA          CA bundle to verify the server (enables TLS)
    TRAINMOVER_NATS_TLS_CERT / _KEY client certificate and key (mutual TLS)
    TRAINMOVER_NATS_INBOX_PREFIX    reply inbox (default `_INBOX.<user>` with a user)
    TRAINMOVER_NATS_REQUIRE_AUTH    1: refuse to run without credentials, or against a
                                    server that does not check them

Secrets are never accepted as flags (they would show in `ps`) and never appear in
`repr()` or `describe()`; every secret loaded is registered with `logs.add_secret`, so
a log line that happens to contain one prints it masked.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainmover.logs import add_secret

ENV = "TRAINMOVER_NATS_"
CREDS_ENV = ENV + "CREDS"
JWT_MARKER = "-----BEGIN NATS USER JWT-----"


class CredentialsError(ValueError):
    """Credentials that cannot be used (unreadable file, bad format); str() is one line."""


@dataclass(frozen=True)
class NatsAuth:
    """What a connection presents to the server. Empty means anonymous."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    nkey_seed: str | None = field(default=None, repr=False)
    jwt_creds_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_hostname: str | None = None
    inbox_prefix: str | None = None
    require_auth: bool = False
    source: str = ""
    """Where the credentials came from (a file or variable name), for messages."""

    @property
    def configured(self) -> bool:
        """True when any credential is set (TLS alone authenticates nobody)."""
        return bool(self.user or self.token or self.nkey_seed or self.jwt_creds_file)

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    def describe(self) -> str:
        """Who this connects as, without any secret: for messages and logs."""
        if self.jwt_creds_file:
            who = f"JWT credentials {self.jwt_creds_file}"
        elif self.nkey_seed:
            who = f"NKey {nkey_public(self.nkey_seed)}" + (f" ({self.user})" if self.user else "")
        elif self.user:
            who = f"user {self.user!r}"
        elif self.token:
            who = "a token"
        else:
            who = "no credentials"
        if self.source:
            who += f" from {self.source}"
        return who + (" over TLS" if self.tls else "")

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for `nats.connect`."""
        opts: dict[str, Any] = {}
        if self.jwt_creds_file:
            opts["user_credentials"] = self.jwt_creds_file
        elif self.nkey_seed:
            opts["nkeys_seed_str"] = self.nkey_seed
        elif self.user:
            opts["user"] = self.user
            opts["password"] = self.password or ""
        if self.token and not self.user:
            opts["token"] = self.token
        prefix = self.inbox_prefix or (f"_INBOX.{self.user}" if self.user else None)
        if prefix:
            opts["inbox_prefix"] = prefix
        if self.tls:
            opts["tls"] = self.ssl_context()
            if self.tls_hostname:
                opts["tls_hostname"] = self.tls_hostname
        return opts

    def ssl_context(self) -> ssl.SSLContext:
        """A client TLS context verifying the server against `tls_ca` (system CAs if unset)."""
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as err:
            raise CredentialsError(f"TLS settings: {err}") from None
        return ctx

    def merged(self, **overrides: Any) -> NatsAuth:
        """A copy with the non-None `overrides` applied."""
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


def nkey_public(seed: str) -> str:
    """The public key (U...) of an NKey user seed."""
    import nkeys

    try:
        return str(nkeys.from_seed(bytearray(seed.strip().encode())).public_key.decode())
    except Exception as err:  # nkeys raises several types for a malformed seed
        raise CredentialsError(f"invalid NKey seed: {type(err).__name__}") from None


def _read_secret(path: str, what: str) -> str:
    try:
        value = Path(path).read_text().strip()
    except OSError as err:
        raise CredentialsError(f"{what} {path}: {err.strerror or err}") from None
    if not value:
        raise CredentialsError(f"{what} {path} is empty")
    return value


def from_file(path: str | Path) -> NatsAuth:
    """Reads a credentials file: our JSON format, or a NATS JWT .creds file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise CredentialsError(f"credentials file {p}: {err.strerror or err}") from None
    if JWT_MARKER in text:
        return NatsAuth(jwt_creds_file=str(p), source=str(p))
    try:
        data = json.loads(text)
    except ValueError:
        raise CredentialsError(
            f"credentials file {p}: neither JSON nor a NATS .creds file"
        ) from None
    if not isinstance(data, dict):
        raise CredentialsError(f"credentials file {p}: expected a JSON object")
    known = {
        "name",
        "role",
        "user",
        "password",
        "token",
        "nkey_seed",
        "inbox_prefix",
        "tls_ca",
        "tls_cert",
        "tls_key",
        "tls_hostname",
    }
    unknown = sorted(set(data) - known)
    if unknown:
        raise CredentialsError(f"credentials file {p}: unknown field(s) {', '.join(unknown)}")
    if not all(isinstance(v, str) for v in data.values()):
        raise CredentialsError(f"credentials file {p}: every value must be a string")

    def rel(value: str | None) -> str | None:
        # TLS paths in the file are relative to the file, so a credentials folder moves whole.
        return str((p.parent / value).resolve()) if value else None

    auth = NatsAuth(
        user=data.get("user"),
        password=data.get("password"),
        token=data.get("token"),
        nkey_seed=data.get("nkey_seed"),
        inbox_prefix=data.get("inbox_prefix"),
        tls_ca=rel(data.get("tls_ca")),
        tls_cert=rel(data.get("tls_cert")),
        tls_key=rel(data.get("tls_key")),
        tls_hostname=data.get("tls_hostname"),
        source=str(p),
    )
    if auth.nkey_seed:
        nkey_public(auth.nkey_seed)  # fail now, with the file's name, not at connect
    return _registered(auth)


def _registered(auth: NatsAuth) -> NatsAuth:
    for secret in (auth.password, auth.token, auth.nkey_seed):
        if secret:
            add_secret(secret)
    return auth


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def from_env(env: Mapping[str, str] | None = None) -> NatsAuth:
    """Credentials from TRAINMOVER_NATS_* variables (and the file they name)."""
    env = os.environ if env is None else env
    auth = from_file(env[CREDS_ENV]) if env.get(CREDS_ENV) else NatsAuth()
    password = env.get(ENV + "PASSWORD")
    if env.get(ENV + "PASSWORD_FILE"):
        password = _read_secret(env[ENV + "PASSWORD_FILE"], "password file")
    token = env.get(ENV + "TOKEN")
    if env.get(ENV + "TOKEN_FILE"):
        token = _read_secret(env[ENV + "TOKEN_FILE"], "token file")
    seed = None
    if env.get(ENV + "NKEY_SEED_FILE"):
        seed = _read_secret(env[ENV + "NKEY_SEED_FILE"], "NKey seed file")
        nkey_public(seed)
    sources = [k for k in env if k.startswith(ENV) and k != ENV + "URL" and env[k]]
    auth = auth.merged(
        user=env.get(ENV + "USER") or None,
        password=password or None,
        token=token or None,
        nkey_seed=seed,
        tls_ca=env.get(ENV + "TLS_CA") or None,
        tls_cert=env.get(ENV + "TLS_CERT") or None,
        tls_key=env.get(ENV + "TLS_KEY") or None,
        tls_hostname=env.get(ENV + "TLS_HOSTNAME") or None,
        inbox_prefix=env.get(ENV + "INBOX_PREFIX") or None,
        require_auth=_truthy(env.get(ENV + "REQUIRE_AUTH")) or None,
    )
    if sources and not auth.source:
        auth = replace(auth, source="$" + sorted(sources)[0])
    return _registered(auth)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the --nats-* credential flags (files only: no secret on the command line)."""
    g = parser.add_argument_group("NATS credentials (default: $TRAINMOVER_NATS_*)")
    a = g.add_argument
    a("--nats-creds", metavar="FILE", help=f"credentials file (or ${CREDS_ENV})")
    a("--nats-user", metavar="NAME", help="user name (password from $TRAINMOVER_NATS_PASSWORD)")
    a("--nats-password-file", metavar="FILE", help="file holding the password")
    a("--nats-token-file", metavar="FILE", help="file holding a token")
    a("--nats-nkey-seed-file", metavar="FILE", help="file holding an NKey user seed")
    a("--nats-tls-ca", metavar="FILE", help="CA bundle that signed the server certificate")
    a("--nats-tls-cert", metavar="FILE", help="client certificate (mutual TLS)")
    a("--nats-tls-key", metavar="FILE", help="client key (mutual TLS)")
    a(
        "--require-auth",
        action="store_true",
        default=None,
        help="refuse to run without credentials or against a server that does not check them",
    )


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> NatsAuth:
    """Credentials from the flags of `add_arguments`, over the environment."""
    auth = from_env(env)
    if getattr(args, "nats_creds", None):
        # An explicit file replaces whatever the environment named.
        auth = replace(from_file(args.nats_creds), require_auth=auth.require_auth)
    seed = None
    if getattr(args, "nats_nkey_seed_file", None):
        seed = _read_secret(args.nats_nkey_seed_file, "NKey seed file")
        nkey_public(seed)
    password = token = None
    if getattr(args, "nats_password_file", None):
        password = _read_secret(args.nats_password_file, "password file")
    if getattr(args, "nats_token_file", None):
        token = _read_secret(args.nats_token_file, "token file")
    auth = auth.merged(
        user=getattr(args, "nats_user", None),
        password=password,
        token=token,
        nkey_seed=seed,
        tls_ca=getattr(args, "nats_tls_ca", None),
        tls_cert=getattr(args, "nats_tls_cert", None),
        tls_key=getattr(args, "nats_tls_key", None),
        require_auth=getattr(args, "require_auth", None),
    )
    return _registered(auth)


_default: NatsAuth | None = None


def set_default(auth: NatsAuth | None) -> None:
    """Makes `auth` what `bus.connect` uses when given none (the CLI sets its flags here)."""
    global _default
    _default = auth


def default() -> NatsAuth:
    """The process's credentials: those set by `set_default`, else from the environment."""
    return _default if _default is not None else from_env()
