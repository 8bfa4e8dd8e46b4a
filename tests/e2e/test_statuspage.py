"""The status page in a real headless Chromium (Debian's package) against a running
local cluster: while a drain happens and after it, the rendered DOM shows the machines,
the standbys, the migration with its phases and downtime, and the step rate; the
screenshot is a real rendering of it."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from matplotlib import image

from tests.e2e.conftest import TP1, WAIT_S
from trainmover.localcluster import LocalCluster as Cluster
from trainmover.statuspage import StatusPage

pytestmark = pytest.mark.timeout(900)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-headless-shell")


def chromium(url: str, profile: Path, *what: str) -> str:
    """Loads `url` headless, lets its scripts run 4 s of virtual time; returns stdout."""
    assert CHROMIUM, "chromium is not installed: make test installs it (tools/system-deps.sh)"
    run = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",  # as root in CI
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--window-size=1200,900",
            "--virtual-time-budget=4000",
            *what,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def row(dom: str, table: str, **data: str) -> str | None:
    """The first <tr> of table `table` whose data-* attributes include `data`."""
    body = dom.split(f'id="{table}"', 1)[1].split("</table>", 1)[0]
    for tr in re.findall(r"<tr [^>]*>.*?</tr>", body, re.S):
        if all(f'data-{k}="{v}"' in tr for k, v in data.items()):
            return tr
    return None


@pytest.mark.parametrize("config", [TP1])
async def test_the_status_page_shows_a_drain(cluster: Cluster, tmp_path: Path) -> None:
    page = StatusPage(cluster.nc, cluster.job, cluster.config.train.steps)
    url = await page.start()
    try:
        await cluster.wait_step("m1", 5, WAIT_S)
        await cluster.wait_standbys_warm(WAIT_S)
        planned = asyncio.Event()
        page.view.listeners.append(lambda m: m.leaver == "m1" and planned.set())
        event_id = await cluster.client.drain(cluster.job, "m1", reason="status page test")
        await asyncio.wait_for(planned.wait(), WAIT_S)

        during = await asyncio.to_thread(chromium, url, tmp_path / "p1", "--dump-dom")
        assert "TrainMover: job" in during and cluster.job in during
        shown = row(during, "in-flight", event=event_id) or row(during, "recent", event=event_id)
        assert shown is not None and 'data-leaver="m1"' in shown, during[-3000:]
        assert row(during, "standbys", machine="s1") is not None

        done = await cluster.client.wait_for_migration(cluster.job, event_id, timeout=WAIT_S)
        assert done.state == "done", done.detail
        png = tmp_path / "status.png"
        after = await asyncio.to_thread(chromium, url, tmp_path / "p2", "--dump-dom")
        await asyncio.to_thread(chromium, url, tmp_path / "p3", f"--screenshot={png}")
    finally:
        await page.stop()

    recent = row(after, "recent", event=event_id, state="done")
    assert recent is not None, after[-3000:]
    assert f"{done.downtime_s:.3f} s" in recent and 'class="phase"' in recent
    assert row(after, "in-flight", event=event_id) is None
    # The joiner serves m1's role; m1 left the machines that serve one.
    joiner = row(after, "machines", machine=done.joiner, status="active")
    assert joiner is not None and "dp0 pp1" in joiner
    assert row(after, "machines", machine="m1") is None
    rate = re.search(r'id="rate">([0-9.]+)<', after)
    assert rate is not None and float(rate.group(1)) > 0
    # A real rendering: the window's size, and not one flat colour.
    pixels = image.imread(png)
    assert pixels.shape[:2] == (900, 1200) and pixels.std() > 0.05
