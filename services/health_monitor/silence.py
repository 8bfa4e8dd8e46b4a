"""How many machines of a job silence alone may fail at once, pure.

A machine whose heartbeats stop is failed by its silence (`heartbeats`). Many machines
silent together are rarely many failures: a loaded host or a slow bus delays every
sidecar's heartbeats at once, and failing them all would move every role together and
leave no replica to take state from. So at most `fraction` of a job's watched machines
(at least one) are believed failed from silence within one heartbeat window, and none
while more than half of them are silent (a lapse waits one heartbeat interval, so that
those of one cause are judged together); the other lapses are *held*. A held machine is
believed when a later window has room for it, or earlier by corroboration that does not
go through here: a failed collective a peer reports, the progress board's stall report,
a worker's exit (machines that really died have live peers that see it). A machine held
in a mass silence is believed only once it stays silent a whole window after the mass
ended: its silence until then is explained by the host's or the bus's, and the others
come back one by one (a held machine still silent when the last but one is heard is
most often the next to be heard, not a failure). A held machine heard again is
forgotten: the silence was the host's or the bus's, and nothing moved.

Time is an argument (monotonic seconds), so this is tested without clocks or processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from trainmover.services.health_monitor.heartbeats import Lapse, MachineKey


@dataclass
class _Held:
    lapse: Lapse
    since: float
    reported: bool = False
    #: When it was last held in a mass silence (too many of its job silent at once).
    massed_at: float = -math.inf


@dataclass
class Verdict:
    """What one judgement decided."""

    believed: list[Lapse] = field(default_factory=list)
    """Lapses to fail their machines now."""
    withheld: list[Lapse] = field(default_factory=list)
    """Lapses judged and held for the first time (not failed: too many silent at once)."""


@dataclass
class SilenceGate:
    """Lapses in, the lapses to believe now out; the rest held (module docstring)."""

    fraction: float
    window_s: float
    #: Seconds a lapse is held before it is judged: heartbeats delayed by one cause lapse
    #: within one heartbeat interval of each other, and are judged together.
    settle_s: float = 0.0
    _held: dict[MachineKey, _Held] = field(default_factory=dict)
    #: When each job's machines were last believed failed from silence.
    _believed: dict[str, dict[str, float]] = field(default_factory=dict)

    def limit(self, watched: int) -> int:
        """Machines of a job of `watched` machines that silence may fail at once."""
        return max(1, math.floor(self.fraction * watched))

    def judge(self, lapses: list[Lapse], now: float, watched: Callable[[str], int]) -> Verdict:
        """The lapses to believe now, of `lapses` and of those held; `watched(job)`: the
        job's watched machines."""
        for lapse in lapses:
            self._held[(lapse.job, lapse.machine)] = _Held(lapse, now)
        verdict = Verdict()
        for job in sorted({job for job, _ in self._held}):
            recent = self._believed.setdefault(job, {})
            for machine in [m for m, at in recent.items() if now - at > self.window_s]:
                del recent[machine]
            held = [h for (j, _), h in self._held.items() if j == job]
            # Held a heartbeat interval first: by then the others of one cause lapsed too.
            settled = sorted(
                (h for h in held if now - h.since >= self.settle_s),
                key=lambda h: -h.lapse.silent_s,  # the longest silent first
            )
            silent, limit = len(recent) + len(held), self.limit(watched(job))
            if 2 * silent > watched(job):
                for h in held:
                    h.massed_at = now
            if 2 * silent > watched(job) or (silent > limit and recent):
                admitted = []  # a host or bus problem, until a window has room or one is named
            else:
                admitted = [h for h in settled if now - h.massed_at >= self.window_s][:limit]
            for h in admitted:
                del self._held[(job, h.lapse.machine)]
                recent[h.lapse.machine] = now
                verdict.believed.append(h.lapse)
            for h in settled[len(admitted) :]:
                if not h.reported:
                    h.reported = True
                    verdict.withheld.append(h.lapse)
        return verdict

    def heard(self, job: str, machine: str) -> bool:
        """`machine` was heard again (or is no longer watched): True when it was held."""
        return self._held.pop((job, machine), None) is not None

    def held(self, job: str) -> list[str]:
        """The machines of `job` held now."""
        return sorted(m for j, m in self._held if j == job)
