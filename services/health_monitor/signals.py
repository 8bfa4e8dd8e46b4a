"""The health-monitor's judgement of each signal: heartbeats, step statistics,
collective-error reports, stall reports and heartbeat lapses become failure or straggler
events for the planner, or a rejection (an unknown machine, a forged sender, an
implausible report); a machine named silent whose heartbeats show it starved of a CPU is
excused (`starvation`). No bus here: the service subscribes and hands each decoded message
in; events go to the Emitter, rejections to the service's dead-letter path.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from nats.aio.msg import Msg

from trainmover.logs import get_logger
from trainmover.messages import (
    ClusterState,
    CollectiveErrorReport,
    FailureEvent,
    Heartbeat,
    MessageError,
    StallReport,
    StepStats,
    StragglerEvent,
    StragglerEvidence,
    decode,
    new_id,
)
from trainmover.services.health_monitor.config import Settings
from trainmover.services.health_monitor.emitter import Emitter
from trainmover.services.health_monitor.events import event_id
from trainmover.services.health_monitor.heartbeats import HeartbeatTracker, Lapse, abnormal_exits
from trainmover.services.health_monitor.metrics import HealthMetrics
from trainmover.services.health_monitor.plausible import (
    ReportRate,
    StepBounds,
    collective_error_problem,
    stall_problem,
)
from trainmover.services.health_monitor.reexamine import reason_to_ask_again
from trainmover.services.health_monitor.roster import Roster
from trainmover.services.health_monitor.silence import SilenceGate
from trainmover.services.health_monitor.starvation import FRESH_S, CpuEvidence, Excuses
from trainmover.services.health_monitor.stragglers import StragglerDetector
from trainmover.subjects import JobSubjects

log = get_logger("health-monitor")

#: How many machine names one log line of a mass silence carries (the count says the rest).
LOGGED_NAMES = 32

Reject = Callable[..., None]
"""The service's rejection path: (job, subject, payload, reason, category, key="")."""


class Signals:
    """Turns one job's signals into events, with the detectors' state of every job."""

    def __init__(
        self,
        settings: Settings,
        roster: Roster,
        tracker: HeartbeatTracker,
        stragglers: StragglerDetector,
        steps: StepBounds,
        metrics: HealthMetrics,
        emitter: Emitter,
        reject: Reject,
    ) -> None:
        self.settings = settings
        self.roster = roster
        self.tracker = tracker
        self.stragglers = stragglers
        self.steps = steps
        self.metrics = metrics
        self.emitter = emitter
        self._reject = reject
        self.cpu = CpuEvidence(fresh_s=max(2 * settings.heartbeat_interval, FRESH_S))
        self.excuses = Excuses()
        #: When each job's last believed step statistics arrived (monotonic).
        self._stats_heard: dict[str, float] = {}
        self.rates = ReportRate(settings.stall_burst, settings.stall_window)
        self.silence = SilenceGate(
            settings.silent_fraction, settings.heartbeat_timeout, settings.heartbeat_interval
        )

    def forget(self, job: str, machine: str) -> None:
        """Drops what the starvation checks kept of a machine the planner settled."""
        self.cpu.forget(job, machine)
        self.excuses.forget(job, machine)
        self.silence.heard(job, machine)

    def _known(self, job: str, machine: str, subject: str, data: bytes, what: str) -> bool:
        """True when the machine is in the job's state; rejects it otherwise."""
        if not self.roster.loaded(job):
            log.debug("signal_before_state", job=job, machine=machine, reason="state not loaded")
            return False
        if self.roster.status(job, machine) is None:
            self._reject(
                job,
                subject,
                data,
                f"unknown machine {machine!r}: not in the cluster state of job {job!r} ({what})",
                "unknown_machine",
                key=machine,
            )
            return False
        return True

    def _check_sender(self, job: str, msg: Msg, message: Heartbeat | StepStats) -> None:
        sender = msg.subject.split(".")[-1]
        if message.job != job or message.machine != sender:
            raise MessageError(
                f"message names {message.job}/{message.machine} but came on {msg.subject}"
            )

    def on_heartbeat(self, job: str, msg: Msg) -> None:
        hb = decode(Heartbeat, msg.data)
        self._check_sender(job, msg, hb)
        # Heard before the checks: a machine not watched yet (not in the cluster state
        # yet, or back from maintenance) that is watched soon is judged from this beat.
        recovered = self.tracker.beat(job, hb.machine, hb.seq, time.monotonic(), hb.ts)
        if not self._known(job, hb.machine, msg.subject, msg.data, "heartbeat"):
            return
        self.cpu.observe(job, hb.machine, hb.workers, time.monotonic())
        self.metrics.heartbeats.labels(job=job).inc()
        if not self.tracker.is_watched(job, hb.machine):
            return  # failed / maintenance: already settled, its heartbeats mean nothing
        if recovered:
            if self.silence.heard(job, hb.machine):
                log.info(
                    "silence_cleared",
                    job=job,
                    machine=hb.machine,
                    reason="heard again while its silence was held: nothing moved",
                )
            log.info(
                "machine_recovered",
                job=job,
                machine=hb.machine,
                seq=hb.seq,
                reason="heartbeat after a lapse",
            )
        self.metrics.machines_up.labels(job=job).set(self.tracker.up_count(job))
        exited = abnormal_exits(hb)
        if exited:
            worker = exited[0]
            ranks = ", ".join(f"local rank {w.local_rank} (code {w.exit_code})" for w in exited)
            anchor = f"exit:{worker.local_rank}:{worker.pid}:{worker.exit_code}"
            self._emit(
                FailureEvent(
                    event_id=event_id(job, hb.machine, "failure", anchor),
                    job=job,
                    machine=hb.machine,
                    reason=f"worker exited abnormally: {ranks}",
                    source="worker_exit",
                    exit_code=worker.exit_code,
                ),
                alive_ts=hb.ts,
            )

    def on_stats(self, job: str, msg: Msg) -> None:
        stats = decode(StepStats, msg.data)
        self._check_sender(job, msg, stats)
        if not self._known(job, stats.machine, msg.subject, msg.data, "step stats"):
            return
        self.metrics.step_stats.labels(job=job).inc()
        if self.roster.status(job, stats.machine) != "active":
            return  # standbys run shadow iterations: their times are not the job's
        problem = self.steps.check(job, stats.machine, stats.step)
        if problem is not None:
            self._reject(job, msg.subject, msg.data, problem, "implausible_stats", stats.machine)
            return
        self._stats_heard[job] = time.monotonic()
        state = self.roster.state(job)
        if state is not None and state.in_flight:
            # A migration's phase 1 builds groups in the background and slows the
            # stayers' compute; no verdicts on speed until it is over.
            return
        finding = self.stragglers.observe(job, stats.machine, stats.step, stats.compute_s)
        if finding is not None:
            self._emit_straggler(
                job,
                stats.machine,
                finding.step,
                finding.evidence,
                f"slow:{finding.first_slow_step}",
            )
        elif state is not None and self.stragglers.is_flagged(job, stats.machine):
            self._reexamine(state, stats.machine, stats.step)

    def _reexamine(self, state: ClusterState, machine: str, step: int) -> None:
        """A machine still flagged: proposes it again if the planner turned its last
        event down and could say yes now (`reexamine`)."""
        job = state.job
        last = self.emitter.open_incident(job, machine, "straggler")
        why = reason_to_ask_again(state, machine, last, time.time(), self.settings.straggler_retry)
        evidence = self.stragglers.evidence(job, machine)
        if why is None or evidence is None:
            return
        log.info("straggler_reexamined", job=job, machine=machine, step=step, reason=why)
        self.emitter.close(job, machine, "straggler", "the planner rejected it; asking again")
        self._emit_straggler(job, machine, step, evidence, f"again:{step}")

    def _emit_straggler(
        self, job: str, machine: str, step: int, ev: StragglerEvidence, anchor: str
    ) -> None:
        self._emit(
            StragglerEvent(
                event_id=event_id(job, machine, "straggler", anchor),
                job=job,
                machine=machine,
                reason=(
                    f"compute time median {ev.machine_median_s:.4f}s over its last {ev.window} "
                    f"steps (to step {step}) above {ev.factor:g} x the job "
                    f"median {ev.job_median_s:.4f}s"
                ),
                evidence=ev,
            ),
            alive_ts=None,
        )

    def on_collective_error(self, job: str, msg: Msg) -> None:
        report = decode(CollectiveErrorReport, msg.data)
        sender = msg.subject.split(".")[-1]
        if report.job != job or report.machine != sender:
            raise MessageError(
                f"message names {report.job}/{report.machine} but came on {msg.subject}"
            )
        if not self._known(job, report.machine, msg.subject, msg.data, "collective error reporter"):
            return
        if not self._known(job, report.peer, msg.subject, msg.data, "blamed peer"):
            return
        state = self.roster.state(job)
        problem = collective_error_problem(state, report) if state is not None else None
        if problem is not None:
            self._reject(job, msg.subject, msg.data, problem, "implausible_report", report.machine)
            return
        if not self.tracker.is_watched(job, report.peer):
            log.info(
                "collective_error_ignored",
                job=job,
                machine=report.peer,
                reporter=report.machine,
                reason=f"peer is already {self.roster.status(job, report.peer)}",
            )
            return
        self._emit(
            FailureEvent(
                event_id=event_id(
                    job, report.peer, "failure", f"collerr:{report.machine}:{report.ts}"
                ),
                job=job,
                machine=report.peer,
                reason=(
                    f"collective error in group {report.group!r} reported by {report.machine}: "
                    f"{report.error}"
                )[:4096],
                source="collective_error",
            ),
            alive_ts=report.ts,
        )

    def on_stall(self, job: str, msg: Msg) -> None:
        report = decode(StallReport, msg.data)
        if report.job != job or msg.subject != JobSubjects(job).stall(report.machine):
            raise MessageError(
                f"message names {report.job}/{report.machine} but came on {msg.subject}"
            )
        state = self.roster.state(job)
        if state is None:
            return
        now = time.monotonic()
        heard = self._stats_heard.get(job)
        quiet = None if heard is None else now - heard
        problem = stall_problem(state, report, self.steps.last(job), quiet) or self.rates.check(
            job, report.machine, report.epoch, report.step, now
        )
        if problem is not None:
            self._reject(job, msg.subject, msg.data, problem, "implausible_report", report.machine)
            return
        for culprit in sorted(report.culprits):
            reason = report.reason
            silent = culprit in report.silent
            starved = self._starved(state, culprit, report, now) if silent else None
            if starved is not None:
                held = self.excuses.held(job, culprit, report.epoch, report.step, now)
                if held < self.settings.starved_grace:
                    log.warning(
                        "stall_excused",
                        job=job,
                        machine=culprit,
                        reporter=report.machine,
                        step=report.step,
                        reason=f"{culprit} is silent but starved of a CPU, not stopped: {starved}",
                    )
                    self.metrics.stalls_excused.labels(job=job).inc()
                    continue  # the judge judges again at its next threshold
                reason += f"; starved of a CPU for {held:.0f}s, past the grace: {starved}"
            self._emit(
                FailureEvent(
                    event_id=event_id(
                        job, culprit, "failure", f"stall:{report.epoch}:{report.step}"
                    ),
                    job=job,
                    machine=culprit,
                    reason=f"{reason} (reported by {report.machine})"[:4096],
                    source="no_progress",
                ),
                alive_ts=None,
            )

    def _starved(
        self, state: ClusterState, machine: str, report: StallReport, now: float
    ) -> str | None:
        """How the workers behind `machine`'s silent ranks were starved of a CPU, by its
        heartbeats; None when they were not (stopped, cut off) or nothing fresh says."""
        layout, cell = state.layout, state.machines[machine].cell
        assert cell is not None  # stall_problem: a culprit holds a role
        ranks = set(report.culprits[machine])
        local = [
            i for i, role in enumerate(layout.roles_of(cell)) if layout.global_rank(role) in ranks
        ]
        # Local rank 0 carries its machine's entries to the job's store: when it was
        # starved, its machine's other ranks read silent too.
        found = self.cpu.starved(state.job, machine, local, now) or self.cpu.starved(
            state.job, machine, [0], now
        )
        return "; ".join(map(str, found)) if found else None

    def on_lapses(self, lapses: list[Lapse], now: float) -> None:
        """New lapses and those held: each believed one fails its machine (`silence`)."""
        verdict = self.silence.judge(lapses, now, lambda job: self.tracker.watched_count(job))
        withheld: dict[str, list[str]] = {}
        for lapse in verdict.withheld:
            withheld.setdefault(lapse.job, []).append(lapse.machine)
            self.metrics.silences_held.labels(job=lapse.job).inc()
        # One line a job, not one a machine naming every machine held: in a mass silence
        # of thousands that was O(n²) to write, and held the monitor's loop for seconds,
        # long enough for the heartbeats it had not read to lapse too.
        for job, machines in withheld.items():
            held = self.silence.held(job)
            log.warning(
                "silence_held",
                job=job,
                machines=machines[:LOGGED_NAMES],
                withheld=len(machines),
                silent=held[:LOGGED_NAMES],
                reason=f"{len(held)} of the job's {self.tracker.watched_count(job)} "
                "machines silent at once: a host or bus problem until a peer names one",
            )
        for lapse in verdict.believed:
            self.on_lapse(lapse)

    def on_lapse(self, lapse: Lapse) -> None:
        if lapse.last_seen is None:
            reason = f"no heartbeat within the {self.tracker.grace_s:g}s grace since watching began"
            # Nothing names this silence across restarts; the stored incident dedups it.
            anchor = f"hb:never:{new_id()}"
            alive_ts = None
        else:
            reason = (
                f"missed heartbeats for {lapse.silent_s:.2f}s (timeout "
                f"{self.tracker.timeout_s:g}s, last seq {lapse.last_seq})"
            )
            anchor = f"hb:{lapse.last_seq}:{lapse.last_sent_ts}"
            alive_ts = time.time() - lapse.silent_s
        self.metrics.machines_up.labels(job=lapse.job).set(self.tracker.up_count(lapse.job))
        self._emit(
            FailureEvent(
                event_id=event_id(lapse.job, lapse.machine, "failure", anchor),
                job=lapse.job,
                machine=lapse.machine,
                reason=reason,
                source="heartbeat",
            ),
            alive_ts=alive_ts,
        )

    def _emit(self, event: FailureEvent | StragglerEvent, alive_ts: float | None) -> None:
        self.emitter.propose(event, alive_ts=alive_ts)
