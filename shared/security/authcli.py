"""`trainmover auth ...`: generate credentials and nats-server configs, rotate, show.

trainmover auth generate --dir D --job job1=m0,m1,s0 [--kind nkey] [--tls-ca F ...]
    per-component credentials in D/creds/, the registry D/users.json, a single-server
    config D/nats-server.conf (bcrypt hashes inline) and D/passwords.conf (the same
    hashes as variables, for the cluster configs of `deploy`)
trainmover auth deploy --spec deploy/nats/cluster.yaml --out deploy/nats
    the configs of a JetStream cluster (nats-N.conf, auth.conf): no secrets, so they
    can be committed; each node also needs passwords.conf from `generate`
trainmover auth rotate --dir D NAME     new secret for one user, configs re-rendered
trainmover auth show --dir D            users and what each may do (no secrets)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from trainmover.security.policy import Component, components_for, describe_table
from trainmover.security.secrets import (
    AUTH_KINDS,
    BCRYPT_ROUNDS,
    AuthKind,
    AuthStore,
    ClientTls,
    SecretsError,
    UserRecord,
    write_private,
)
from trainmover.security.serverconf import (
    HEADER,
    ServerTls,
    render_authorization,
    render_cluster_node,
    render_password_vars,
    render_server,
)
from trainmover.subjects import InvalidName, check_name

SERVER_CONF = "nats-server.conf"
SERVER_TLS = "server-tls.json"
PASSWORDS_CONF = "passwords.conf"
AUTH_CONF = "auth.conf"


class AuthCliError(ValueError):
    """Bad input to `trainmover auth`; str() is one line."""


def parse_job(spec: str) -> tuple[str, list[str]]:
    """`job1=m0,m1` -> ("job1", ["m0", "m1"]); `job1` alone has no sidecars."""
    job, _, machines = spec.partition("=")
    try:
        check_name("job", job)
        names = [check_name("machine", m.strip()) for m in machines.split(",") if m.strip()]
    except InvalidName as err:
        raise AuthCliError(str(err)) from None
    return job, names


def write_server_files(
    store: AuthStore, records: list[UserRecord], tls: ServerTls | None = None
) -> Path:
    """(Re)writes the single-server config and the password variables of `records`;
    the server TLS settings are remembered for a later re-render (rotation)."""
    remembered = store.root / SERVER_TLS
    if tls is not None:
        write_private(remembered, json.dumps(vars(tls)))
    elif remembered.exists():
        tls = ServerTls(**json.loads(remembered.read_text()))
    conf = store.root / SERVER_CONF
    write_private(conf, render_server(records, tls))
    write_private(store.root / PASSWORDS_CONF, render_password_vars(records))
    return conf


def generate(
    root: str | Path,
    jobs: dict[str, list[str]],
    *,
    kind: AuthKind = "password",
    client_tls: ClientTls | None = None,
    server_tls: ServerTls | None = None,
    rounds: int = BCRYPT_ROUNDS,
    admin: bool = True,
) -> tuple[AuthStore, list[UserRecord]]:
    """Credentials for every component of `jobs` in `root`, and the server config."""
    store = AuthStore(root)
    records = store.ensure(components_for(jobs, admin=admin), kind, client_tls, rounds)
    write_server_files(store, records, server_tls)
    return store, records


def deploy_files(spec: dict[str, Any]) -> dict[str, str]:
    """The cluster configs for a deploy spec: {hosts: [...], jobs: {job: [machines]}}."""
    try:
        hosts = [str(h) for h in spec["hosts"]]
        jobs = {str(j): [str(m) for m in ms or []] for j, ms in spec["jobs"].items()}
    except (KeyError, TypeError, AttributeError) as err:
        raise AuthCliError(
            f"deploy spec: expected hosts: [...] and jobs: {{...}} ({err})"
        ) from None
    options = {k: spec[k] for k in ("cluster_name", "store_dir") if k in spec}
    records = [UserRecord(c, "password") for c in components_for(jobs)]
    files = {
        f"nats-{i + 1}.conf": render_cluster_node(i, hosts, **options) for i in range(len(hosts))
    }
    files[AUTH_CONF] = HEADER + render_authorization(
        records, password_vars=True, secrets_file=PASSWORDS_CONF
    )
    return files


def _client_tls(args: argparse.Namespace) -> ClientTls | None:
    if not (args.tls_ca or args.tls_cert):
        return None
    return ClientTls(args.tls_ca, args.tls_cert, args.tls_key)


def _server_tls(args: argparse.Namespace) -> ServerTls | None:
    if not args.server_tls_cert:
        return None
    if not args.server_tls_key:
        raise AuthCliError("--server-tls-cert needs --server-tls-key")
    return ServerTls(
        str(Path(args.server_tls_cert).resolve()),
        str(Path(args.server_tls_key).resolve()),
        str(Path(args.server_tls_ca).resolve()) if args.server_tls_ca else None,
        args.server_tls_verify,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    jobs = dict(parse_job(spec) for spec in args.job)
    store, records = generate(
        args.dir,
        jobs,
        kind=args.kind,
        client_tls=_client_tls(args),
        server_tls=_server_tls(args),
        rounds=args.bcrypt_cost,
        admin=not args.no_admin,
    )
    print(f"{len(records)} users in {store.registry_path}")
    print(f"credentials: {store.creds_dir}/<user>.json (give each component its own)")
    print(f"server config: {store.root / SERVER_CONF}  (nats-server -c ...)")
    print(f"cluster password variables: {store.root / PASSWORDS_CONF}")
    return 0


def _cmd_deploy(args: argparse.Namespace) -> int:
    try:
        spec = yaml.safe_load(Path(args.spec).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise AuthCliError(f"deploy spec {args.spec}: {str(err).splitlines()[0]}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in deploy_files(spec or {}).items():
        (out / name).write_text(text)
        print(out / name)
    return 0


def _cmd_rotate(args: argparse.Namespace) -> int:
    store = AuthStore(args.dir)
    record = store.rotate(args.name, rounds=args.bcrypt_cost)
    records = list(store.load().values())
    conf = write_server_files(store, records)
    print(f"new secret for {record.name} in {store.creds_file(record.name)}")
    print(
        f"reload the server (nats-server --signal reload, or SIGHUP) to apply {conf}; copy "
        f"{store.root / PASSWORDS_CONF} to cluster nodes first"
    )
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    for name, record in sorted(AuthStore(args.dir).load().items()):
        c: Component = record.component
        where = f" jobs={','.join(c.jobs)}" if c.jobs else ""
        where += f" machine={c.machine}" if c.machine else ""
        print(f"{name}  ({c.role}, {record.kind}){where}")
        for direction, subject in describe_table(c):
            print(f"    {direction:<9} {subject}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainmover auth", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="action", required=True)

    g = sub.add_parser("generate", help="credentials and a server config")
    g.add_argument("--dir", required=True, help="auth directory (created 0700)")
    g.add_argument(
        "--job", action="append", default=[], metavar="JOB[=M1,M2]", help="job and its machines"
    )
    g.add_argument("--kind", choices=AUTH_KINDS, default="password", help="password or NKey")
    g.add_argument("--no-admin", action="store_true", help="no all-powerful admin user")
    g.add_argument("--bcrypt-cost", type=int, default=BCRYPT_ROUNDS, help="bcrypt cost")
    g.add_argument("--tls-ca", help="CA file components verify the server with")
    g.add_argument("--tls-cert", help="client certificate for every component (mutual TLS)")
    g.add_argument("--tls-key", help="client key")
    g.add_argument("--server-tls-cert", help="server certificate (enables TLS)")
    g.add_argument("--server-tls-key", help="server key")
    g.add_argument("--server-tls-ca", help="CA the server verifies clients with")
    g.add_argument("--server-tls-verify", action="store_true", help="require client certs")

    d = sub.add_parser("deploy", help="cluster configs from a spec (no secrets)")
    d.add_argument("--spec", required=True, help="YAML: hosts: [...], jobs: {job: [machines]}")
    d.add_argument("--out", required=True)

    r = sub.add_parser("rotate", help="replace one user's secret")
    r.add_argument("--dir", required=True)
    r.add_argument("--bcrypt-cost", type=int, default=BCRYPT_ROUNDS)
    r.add_argument("name", help="user name, e.g. planner or sidecar.job1.m0")

    s = sub.add_parser("show", help="users and their permissions")
    s.add_argument("--dir", required=True)
    return p


COMMANDS = {
    "generate": _cmd_generate,
    "deploy": _cmd_deploy,
    "rotate": _cmd_rotate,
    "show": _cmd_show,
}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.action](args)
    except (AuthCliError, SecretsError, ValueError, OSError) as err:
        print(f"trainmover auth: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
