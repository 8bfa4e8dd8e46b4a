"""deploy/slurm/trainmover.sbatch, run by bash with Slurm's two commands recorded.

There is no Slurm cluster here, so `scontrol show hostnames` and `srun` are small
recording stand-ins on PATH; everything else (the script's arithmetic, the layout check
through the real job config loader, the Prometheus file_sd file) is real.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.deploy.files import DEPLOY, check_command
from trainmover import ports

COVERS = ["slurm/trainmover.sbatch"]

SCRIPT = DEPLOY / "slurm" / "trainmover.sbatch"

SCONTROL = """#!/bin/sh
# scontrol show hostnames LIST: one host per line (LIST is comma-separated here).
[ "$1 $2" = "show hostnames" ] || exit 64
echo "$3" | tr ',' '\\n'
"""

SRUN = """#!/bin/sh
# Records one job step's command line; the step then ends. A sidecar step first waits
# (up to 30 s) until the store step is recorded, as in a real job where the store
# outlives the sidecars: the script stops the store once they ended, and a store step
# killed before it recorded anything would be missing from the log.
printf '%s\\n' "$*" >> "$SRUN_LOG"
case "$*" in
*" sidecar "*)
    if [ -n "$WAIT_FOR_STORE" ]; then
        i=0
        until grep -q " rendezvous " "$SRUN_LOG" || [ $i -ge 600 ]; do
            sleep 0.05; i=$((i + 1))
        done
    fi ;;
esac
"""


def run_script(
    tmp_path: Path, nodes: list[str], standbys: int, rendezvous: str = ""
) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    job = tmp_path / "job.yaml"
    # 3 training machines: PP3 x DP1.
    job.write_text("job: slurm-test\nlayout: {tp: 2, pp: 3, dp: 1}\nmodel: {n_layers: 3}\n")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": ",".join(nodes),
        "SRUN_LOG": str(tmp_path / "srun.log"),
        "TRAINMOVER_NATS_URL": "nats://u:p@nats-1:4222",
        "TRAINMOVER_JOB_CONFIG": str(job),
        "TRAINMOVER_STANDBY_NODES": str(standbys),
        "TRAINMOVER_PYTHON": sys.executable,
        "TRAINMOVER_SD_FILE": str(tmp_path / "sd.json"),
    }
    env.pop(ports.RENDEZVOUS_ENV, None)
    if rendezvous:
        env[ports.RENDEZVOUS_ENV] = rendezvous
    else:
        env["WAIT_FOR_STORE"] = "1"
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_sidecar_per_node_and_the_last_nodes_standby(tmp_path: Path) -> None:
    nodes = ["gpu-01", "gpu-02", "gpu-03", "gpu-04", "gpu-05"]
    run = run_script(tmp_path, nodes, standbys=2)
    assert run.returncode == 0, run.stderr
    # The steps run in the background, so they are recorded in any order.
    steps = [shlex.split(line) for line in (tmp_path / "srun.log").read_text().splitlines()]
    by_node = {}
    # The rendezvous store: a second step on the first node, the sidecars' --rendezvous.
    (store_step,) = [step for step in steps if "rendezvous" in step[step.index("trainmover") :]]
    steps.remove(store_step)
    assert "--overlap" in store_step and f"--nodelist={nodes[0]}" in store_step
    store = check_command(store_step[store_step.index("trainmover") :])
    assert store.flags["--store-port"] == str(ports.RENDEZVOUS_PORT)
    assert store.flags["--store-host"] == "0.0.0.0"
    for step in steps:
        (where,) = [a for a in step if a.startswith("--nodelist=")]
        by_node[where.removeprefix("--nodelist=")] = step
    assert len(steps) == len(by_node) == len(nodes) and set(by_node) == set(nodes)
    standby = []
    for node in nodes:
        step = by_node[node]
        # One task on exactly that node, and a dead node ends only its own step.
        assert "--nodes=1" in step and "--ntasks=1" in step
        assert "--kill-on-bad-exit=0" in step
        command = check_command(step[step.index("trainmover") :])
        assert command.service == "sidecar"
        assert command.flags["--machine"] == node
        assert command.flags["--rendezvous"] == f"{nodes[0]}:{ports.RENDEZVOUS_PORT}"
        assert command.flags["--job-config"].endswith("job.yaml")  # type: ignore[union-attr]
        # The URL (it may carry credentials) travels in the environment, not on `ps`.
        assert "--nats-url" not in command.flags
        if "--standby" in command.flags:
            standby.append(node)
    assert standby == nodes[3:]

    sd = json.loads((tmp_path / "sd.json").read_text())
    port = ports.DEFAULT_HTTP_PORTS["sidecar"]
    assert [g["targets"] for g in sd] == [
        [f"{n}:{port}" for n in nodes[:3]],
        [f"{n}:{port}" for n in nodes[3:]],
    ]
    assert [g["labels"]["trainmover_pool"] for g in sd] == ["train", "standby"]


def test_a_rendezvous_store_off_the_allocation_is_used_as_given(tmp_path: Path) -> None:
    nodes = ["gpu-01", "gpu-02", "gpu-03", "gpu-04"]
    run = run_script(tmp_path, nodes, standbys=1, rendezvous="ctl-1:29400")
    assert run.returncode == 0, run.stderr
    steps = [shlex.split(line) for line in (tmp_path / "srun.log").read_text().splitlines()]
    assert len(steps) == len(nodes)  # sidecars only: no store started
    for step in steps:
        command = check_command(step[step.index("trainmover") :])
        assert command.service == "sidecar"
        assert command.flags["--rendezvous"] == "ctl-1:29400"


def test_an_allocation_that_does_not_fit_the_layout_is_refused(tmp_path: Path) -> None:
    run = run_script(tmp_path, ["gpu-01", "gpu-02", "gpu-03", "gpu-04"], standbys=2)
    assert run.returncode == 2
    assert "needs 3 training nodes plus 2 standbys" in run.stderr
    assert "sbatch --nodes=5" in run.stderr
    assert not (tmp_path / "srun.log").exists()


def test_sbatch_header_reserves_whole_nodes_and_survives_a_node_failure() -> None:
    header = [
        line.removeprefix("#SBATCH ").strip()
        for line in SCRIPT.read_text().splitlines()
        if line.startswith("#SBATCH ")
    ]
    assert "--no-kill" in header and "--exclusive" in header
    assert "--ntasks-per-node=1" in header
