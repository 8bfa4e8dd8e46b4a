"""The state dumps a job config asks for (`train.dump_steps`, `train.dump_every`): a
role's full state after a step, saved under the run folder for comparisons between runs
(the bit-identical checks of the tests, the demo and the chaos soak).

A dump is the role's state as the rank that trained the step holds it. A failure's
joiner restored at a step from a DP replica holds the replica's per-replica RNGs (the
role's own died with it; the leaver saved its dump, if it got that far): it marks that
step's dump as skipped (`trainmover.runtime.compare.skip_marker`) and saves from its next
dump step on.
"""

from __future__ import annotations

from trainmover.runtime import fault
from trainmover.runtime.compare import skip_marker
from trainmover.runtime.core import Core


def maybe_dump(core: Core, step: int, last: bool = False) -> None:
    """Saves the state after `step` if the config asks for it (once per role and step).
    A job whose end was brought forward (`last`: `step` is its last step now) saves it
    where the config saves its configured last step."""
    role, state, train = core.accepted.role, core.state, core.config.train
    wanted = train.dumps_at(step) or (last and train.dumps_at(train.steps))
    if not wanted or state is None or role is None:
        return
    fault.point("before-dump")  # test-only: a machine dies after the step, before its dump
    folder = core.run_dir / "state"
    folder.mkdir(parents=True, exist_ok=True)
    if core.replica_state_at == step:
        reason = "state from a DP replica"
        core.log.info("dump_skipped", step=step, reason=reason)
        skip_marker(folder, role.key, step).write_text(reason + "\n")
        return
    path = folder / f"{role.key}.step{step}.pt"
    if not path.exists():
        state.save(path)
