"""TrainMover runtime: the library inside every worker process.

It owns the reconfigurable communication groups, the step boundary where a migration's
switch happens, and the peer state transfer from a leaver to its joiner.

Importing this package is cheap on purpose (no torch): the planner imports
`trainmover.runtime.layout` and `trainmover.runtime.plan` only. The training-side entry
point is `trainmover.runtime.worker.Runtime`; the supervising side is
`trainmover.localjob.LocalJob`.
"""
