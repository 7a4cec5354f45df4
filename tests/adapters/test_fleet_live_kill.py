"""Slow and opt-in (``OFFPOLICY_SLOW_LIVE=1``; marker ``slow_live``, deselected otherwise): the live trainer's
process killed and the same command run again, as a user would do it.

``examples/live_fleet.py`` runs in ``.venv-vllm`` as its own process group (two vLLM-on-CPU engine groups under a
local Ray instance, ``STEPS`` steps of ``BATCH`` two-turn sessions, the trainer's state checkpointed after every
step). Once it has printed step ``KILL_AFTER`` (so that step is checkpointed and the next batch is on the engines),
the whole process group is killed with SIGKILL: the trainer, Ray's processes and the engine actors. What survives
is listed (and then killed by process id); no engine may. The same command then runs again with the same ``--out``:
new engines start, the run resumes after the checkpoint's step and ends with exit 0. Its ``history.json`` must show:
resumed after the checkpoint's step; the restored weights published as the version after the newest the killed
run published (no "version must grow" error); steps 0..STEPS-1 each once; no session trained twice or with a turn missing; served versions
matching the tokens' stamps and none older than the restored weights' (``toy_run.check_history``); sessions lost
= the one batch in flight at the kill.

Run it: ``OFFPOLICY_SLOW_LIVE=1 nice .venv/bin/python -m pytest -q -s -p no:cacheprovider
tests/adapters/test_fleet_live_kill.py``; with ``OFFPOLICY_LIVE_KILL_OUT=DIR`` the measured counts
(``result.json``), both runs' output and the final ``history.json`` are copied into DIR. Two engine starts take
minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from offpolicy.adapters.fleet_live.toy_run import RunConfig, check_history

psutil = pytest.importorskip("psutil")

pytestmark = [pytest.mark.live_engine, pytest.mark.slow_live]

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("OFFPOLICY_VLLM_VENV", ROOT / ".venv-vllm"))
GROUPS = "cpu-bf16:bf16,cpu-nvfp4:nvfp4"
STEPS, KILL_AFTER = 6, 1
TURNS = RunConfig().turns
BATCH = RunConfig().prompts * RunConfig().samples  # sessions per step (the example's RunConfig defaults)
RUN_TIMEOUT_S = 900.0


def launch(out: Path, log: Path) -> subprocess.Popen:
    """The documented command, in its own process group (session), its output into ``log``."""
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PYTHONPATH"] = str(ROOT / "src")
    cmd = [str(VENV / "bin" / "python"), str(ROOT / "examples" / "live_fleet.py"), "--steps", str(STEPS),
           "--groups", GROUPS, "--checkpoint-every", "1", "--out", str(out)]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(proc: subprocess.Popen, log: Path, pattern: str, timeout: float) -> None:
    """Wait until a line of ``log`` matches ``pattern``; fail (with the output's tail) if the process ends first."""
    rx, t0 = re.compile(pattern, re.M), time.monotonic()
    while time.monotonic() - t0 < timeout:
        if rx.search(log.read_text(errors="replace")):
            return
        if proc.poll() is not None:
            pytest.fail(f"exited {proc.returncode} before printing {pattern!r}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no line {pattern!r} within {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def processes_of(pid: int) -> list:
    """Every process under ``pid`` and every process of its session (what it started, however deep)."""
    procs = {p.pid: p for p in psutil.Process(pid).children(recursive=True)}
    for p in psutil.process_iter():
        try:
            if p.pid != pid and os.getsid(p.pid) == pid:
                procs.setdefault(p.pid, p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return list(procs.values())


def title(p) -> str:
    try:
        return " ".join(p.cmdline())[:120] or p.name()
    except psutil.Error:
        return "?"


def kill_process_group(proc: subprocess.Popen) -> tuple[list[str], list[str]]:
    """SIGKILL ``proc``'s whole process group; returns the titles of the processes it had and of those that
    survived it (which are then killed, each by its id)."""
    procs = processes_of(proc.pid)
    titles = {p.pid: title(p) for p in procs}
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    t0 = time.monotonic()
    alive = procs
    while alive and time.monotonic() - t0 < 15:
        time.sleep(0.5)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return sorted(titles.values()), sorted(titles[p.pid] for p in alive)


def test_the_trainer_process_killed_and_run_again_resumes_from_its_checkpoint(tmp_path):
    python = VENV / "bin" / "python"
    probe = "import importlib.util as u, sys; sys.exit(not (u.find_spec('vllm') and u.find_spec('ray')))"
    if not python.exists() or subprocess.run([str(python), "-c", probe], timeout=60).returncode != 0:
        pytest.fail(f"{VENV} lacks vllm or ray: run `bash tools/setup_vllm_env.sh`", pytrace=False)
    out, log1, log2 = tmp_path / "run", tmp_path / "stdout_killed.txt", tmp_path / "stdout_resumed.txt"

    t0 = time.monotonic()
    first = launch(out, log1)
    wait_for(first, log1, rf"^step +{KILL_AFTER} ", RUN_TIMEOUT_S)
    killed_s = time.monotonic() - t0
    had, survived = kill_process_group(first)
    engines = [t for t in had if "EngineGroup" in t]
    assert len(engines) == 2, had  # the snapshot saw both engine actors' processes
    assert not [t for t in survived if "EngineGroup" in t], survived  # no engine outlives the kill
    state = torch.load(out / "trainer.pt", weights_only=False)
    checkpointed = int(state["step"])
    assert checkpointed >= KILL_AFTER
    killed = json.loads((out / "history.json").read_text())
    published = int((out / "weights" / "LATEST").read_text())  # the newest version the killed run published

    t1 = time.monotonic()
    second = launch(out, log2)
    try:
        rc = second.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_process_group(second)
        pytest.fail(f"the rerun did not end within {RUN_TIMEOUT_S:.0f} s:\n{log2.read_text()[-4000:]}")
    rerun_s = time.monotonic() - t1
    text = log2.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    assert "version must grow" not in text
    assert f"resuming after step {checkpointed} from" in text, text[-4000:]
    record = json.loads((out / "history.json").read_text())
    steps = record["steps"]
    assert record["resumed_at"] == checkpointed + 1
    assert [s["step"] for s in steps] == list(range(STEPS))
    # the published version goes on from the killed run's newest: the restored weights are the rerun's first publish
    assert steps[checkpointed + 1]["version"] == published + 1
    assert check_history(steps, TURNS, record["resumed_at"]) == [] and record["checks"] == []
    counts = record["audit"]
    assert counts == {"sent": (STEPS + 1) * BATCH, "trained": STEPS * BATCH, "duplicated": 0, "incomplete": 0,
                      "lost": BATCH}, counts  # only the batch in flight at the kill
    assert not [e for e in record["events"] if e["kind"] in ("died", "hung", "dropped")], record["events"]
    served = {v for s in steps[checkpointed + 1:] for sess in s["sessions"] for _, v, _ in sess["turns"]}

    result = {
        "command": record["command"], "steps": STEPS, "batch": BATCH, "killed_after_printing_step": KILL_AFTER,
        "checkpointed_step": checkpointed, "newest_version_published_by_the_killed_run": published,
        "restored_version": steps[checkpointed + 1]["version"], "served_versions_after_resume": sorted(served),
        "sessions": counts, "killed_run_audit_at_its_last_step": killed.get("audit"),
        "processes_killed": len(had), "engine_processes_killed": len(engines), "survived_the_group_kill": survived,
        "seconds": {"first_run_until_kill": round(killed_s, 1), "first_run_engine_start": killed.get("start_s"),
                    "rerun": round(rerun_s, 1), "rerun_engine_start": record.get("start_s"),
                    "total": round(time.monotonic() - t0, 1)},
    }
    print(json.dumps(result, indent=1))
    keep = os.environ.get("OFFPOLICY_LIVE_KILL_OUT")
    if keep:
        dest = Path(keep)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "result.json").write_text(json.dumps(result, indent=1) + "\n")
        for f in (log1, log2, out / "history.json", out / "history.png"):
            shutil.copy(f, dest / f.name)
