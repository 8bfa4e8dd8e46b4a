"""Bus security: who may connect to NATS and what each component may do there.

Modules, one job each:
    credentials  how a component gets its NATS credentials and TLS settings (file, env,
                 flags) and turns them into `nats.connect` options; the one helper
                 every `bus.connect` caller goes through
    policy       the least-privilege permission table: per role, the subjects it may
                 publish and subscribe, derived from `subjects.JobSubjects`
    secrets      generating, hashing (bcrypt), storing and loading per-component secrets
    serverconf   rendering nats-server configuration (users and permissions, TLS,
                 a JetStream cluster node) from the policy and the secrets
    denials      permission violations the server reports, surfaced as PermissionDenied
    authcli      `trainmover auth ...`: generate credentials and server configs
"""
