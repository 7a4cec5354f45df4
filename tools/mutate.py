"""Mutation testing: apply realistic one-line mutants to the library and check that the test suite kills each one.

    python tools/mutate.py                 # every mutant in tools/mutants.toml
    python tools/mutate.py --only mis_bounds_exclusive,grad_detach
    python tools/mutate.py --list

Each mutant names a file, an exact piece of code (which must occur exactly once), its replacement and the tests that
should kill it. The tool applies the mutant in place, runs those tests with ``pytest -x -q``, restores the file
byte for byte (also on Ctrl-C) and records whether the tests failed (killed), passed (survived), or the mutant no
longer applies (stale: the code moved; update the catalogue). A survivor is either a missing test (write it) or an
equivalent mutant (mark it ``equivalent = "why"`` in the catalogue). The run writes a JSON report and exits non-zero
when a non-equivalent mutant survived or one is stale.

It is a tool to run by hand (minutes), not part of the CI test command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CATALOGUE = Path(__file__).with_name("mutants.toml")


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    equivalent: str | None = None


def load(path: Path = CATALOGUE) -> list[Mutant]:
    data = tomllib.loads(path.read_text())
    out = []
    for name, entry in data.items():
        missing = {"file", "find", "replace", "tests"} - set(entry)
        if missing:
            raise ValueError(f"{path}: mutant {name!r} lacks {sorted(missing)}")
        out.append(Mutant(name, entry["file"], entry["find"], entry["replace"], tuple(entry["tests"]),
                          entry.get("equivalent")))
    return out


def run_one(m: Mutant, python: str, timeout: float) -> dict:
    path = ROOT / m.file
    original = path.read_bytes()
    text = original.decode()
    count = text.count(m.find)
    if count != 1:
        return {"name": m.name, "status": "stale", "detail": f"{m.find!r} occurs {count} times in {m.file}"}
    start = time.perf_counter()
    try:
        path.write_text(text.replace(m.find, m.replace))
        env = dict(os.environ, OFFPOLICY_HYPOTHESIS_EXAMPLES=os.environ.get("OFFPOLICY_HYPOTHESIS_EXAMPLES", "40"))
        try:
            proc = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            status = "killed" if proc.returncode != 0 else "survived"
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        except subprocess.TimeoutExpired:
            status, tail = "killed", ["timed out (counted as killed: the mutant hangs the tests)"]
    finally:
        path.write_bytes(original)
    if status == "survived" and m.equivalent:
        status = "equivalent"
    return {"name": m.name, "status": status, "file": m.file, "seconds": round(time.perf_counter() - start, 1),
            "detail": m.equivalent if status == "equivalent" else tail[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated mutant names")
    ap.add_argument("--list", action="store_true", help="list the catalogue and exit")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs pytest")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    ap.add_argument("--out", type=Path, default=ROOT / "mutation_report.json")
    args = ap.parse_args(argv)
    mutants = load()
    if args.list:
        for m in mutants:
            print(f"{m.name:40s} {m.file}")
        return 0
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {m.name for m in mutants}
        if unknown:
            ap.error(f"--only: unknown mutants {sorted(unknown)}")
        mutants = [m for m in mutants if m.name in wanted]
    results = []
    for m in mutants:
        res = run_one(m, args.python, args.timeout)
        results.append(res)
        print(f"{res['status']:10s} {m.name:40s} {res.get('seconds', '')}s  {res['detail']}", flush=True)
    counts = {s: sum(r["status"] == s for r in results) for s in ("killed", "survived", "equivalent", "stale")}
    live = counts["killed"] + counts["survived"]
    print(f"\n{counts['killed']}/{live} non-equivalent mutants killed; {counts['equivalent']} equivalent, "
          f"{counts['stale']} stale")
    args.out.write_text(json.dumps({"counts": counts, "results": results}, indent=1))
    return 0 if counts["survived"] == 0 and counts["stale"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
