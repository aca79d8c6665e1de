"""Sandbox figures (docs/sandbox.md): start latency per backend, the 30,000-row comparison inside
the sandbox against the same code outside it, and executions per second with several at once.

    sudo .venv/bin/python bench/sandbox.py [--starts 40] [--parallel 4] [--backends bubblewrap,gvisor]

Runs the backends directly (no runner HTTP in between: that is loopback JSON, a millisecond or
two). "Outside" is the same interpreter and runtime (/usr/bin/python3 with the sandbox's pandas)
as a plain subprocess, so the difference is the sandbox alone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sandbox.backends import BackendUnavailable, Bubblewrap, Execution
from sandbox.limits import Limits

RUNTIME = ROOT / "var" / "sandbox-runtime"
PREAMBLE = "import sys\nsys.path.insert(0, {site!r})\n"
PANDAS_TASK = """
import json
import pandas as pd
card = pd.read_csv('{d}/card.csv')
ledger = pd.read_csv('{d}/ledger.csv')
duplicates = int(card.duplicated('txn_id').sum())
card = card.drop_duplicates('txn_id')
missing = int((~card.txn_id.isin(ledger.txn_id)).sum())
both = card.merge(ledger, on='txn_id', suffixes=('_card', '_ledger'))
print(json.dumps({{"duplicates": duplicates, "missing": missing,
                   "mismatches": int((both.amount_card != both.amount_ledger).sum())}}))
"""
STDLIB_TASK = """
import csv, json
card = list(csv.DictReader(open('{d}/card.csv')))
ledger = {{r['txn_id']: r['amount'] for r in csv.DictReader(open('{d}/ledger.csv'))}}
seen, duplicates, missing, mismatches = set(), 0, 0, 0
for row in card:
    if row['txn_id'] in seen:
        duplicates += 1
        continue
    seen.add(row['txn_id'])
    if row['txn_id'] not in ledger:
        missing += 1
    elif ledger[row['txn_id']] != row['amount']:
        mismatches += 1
print(json.dumps({{"duplicates": duplicates, "missing": missing, "mismatches": mismatches}}))
"""


def data() -> dict[str, bytes]:
    sys.path.insert(0, str(ROOT))
    from tests.sandbox_runner import make_data  # the e2e test's data: same flaws, same size

    card, ledger, _, _ = make_data()
    return {"card.csv": card, "ledger.csv": ledger}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def starts(backend, n: int) -> list[float]:
    execution = Execution(code="pass", inputs={}, limits=Limits())
    backend.execute(execution, slot=0)  # warm the page cache
    out = []
    for _ in range(n):
        began = time.perf_counter()
        outcome = backend.execute(execution, slot=0)
        out.append(time.perf_counter() - began)
        assert outcome.exit_code == 0, outcome.stderr
    return out


def bare_starts(n: int) -> list[float]:
    """The same interpreter start outside any sandbox: what the machine's load leaves of it."""
    out = []
    for _ in range(n):
        began = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-I", "-S", "-B", "-c", "pass"], env={}, check=True)
        out.append(time.perf_counter() - began)
    return out


def bwrap_starts(backend, n: int) -> list[float]:
    """bwrap alone around the same start, run by hand as root: the namespaces, /usr, a private
    /proc and /dev, nothing of the runner (no cgroup, uid, seccomp, harness, work directory).
    What is left above the bare interpreter is bubblewrap's own cost: no runner change goes
    below this line."""
    args = [backend.bwrap, "--unshare-all", "--unshare-user", "--as-pid-1", "--die-with-parent"]
    args += ["--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
    for link in ("lib", "lib64", "bin", "sbin"):
        if os.path.islink(f"/{link}"):
            args += ["--symlink", os.readlink(f"/{link}"), f"/{link}"]
    args += ["/usr/bin/python3", "-I", "-S", "-B", "-c", "pass"]
    out = []
    for _ in range(n):
        began = time.perf_counter()
        subprocess.run(args, env={}, check=True)
        out.append(time.perf_counter() - began)
    return out


def inside(backend, code: str, files: dict, rounds: int) -> tuple[float, str]:
    execution = Execution(code=code.format(d="/in"), inputs=files, limits=Limits())
    times, answer = [], ""
    for _ in range(rounds):
        began = time.perf_counter()
        outcome = backend.execute(execution, slot=0)
        times.append(time.perf_counter() - began)
        assert outcome.exit_code == 0, outcome.stderr.decode()
        answer = outcome.stdout.decode().strip()
    return statistics.median(times), answer


def outside(code: str, files: dict, rounds: int, tmp: Path) -> tuple[float, str]:
    for name, content in files.items():
        (tmp / name).write_bytes(content)
    program = PREAMBLE.format(site=str(RUNTIME / "site-packages")) + code.format(d=str(tmp))
    times, answer = [], ""
    for _ in range(rounds):
        began = time.perf_counter()
        done = subprocess.run(
            ["/usr/bin/python3", "-I", "-S", "-B", "-c", program], capture_output=True, env={}
        )
        times.append(time.perf_counter() - began)
        assert done.returncode == 0, done.stderr.decode()
        answer = done.stdout.decode().strip()
    return statistics.median(times), answer


def parallel(backend, workers: int, total: int) -> float:
    execution = Execution(code="sum(range(100000))", inputs={}, limits=Limits())
    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(backend.execute, execution, slot=i % workers) for i in range(total)]
        for f in futures:
            assert f.result().exit_code == 0
    return total / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--starts", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--backends", default="bubblewrap,gvisor")
    args = parser.parse_args()
    files = data()
    tmp = Path(f"/tmp/sandbox-bench-{os.getpid()}")
    tmp.mkdir(exist_ok=True)
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    bare = bare_starts(args.starts)
    print(
        f"bare python -I -S -c pass, no sandbox: p50 {pct(bare, 0.5) * 1000:.1f} ms, p95 {pct(bare, 0.95) * 1000:.1f} ms"
    )
    for name in args.backends.split(","):
        if name == "gvisor":
            from sandbox.gvisor import Gvisor

            backend = Gvisor(runtime=str(RUNTIME))
        else:
            backend = Bubblewrap(runtime=str(RUNTIME))
        try:
            backend.check()
        except BackendUnavailable as exc:
            print(f"\n{name}: unavailable ({exc})")
            continue
        backend.prepare()
        n = args.starts if name == "bubblewrap" else max(10, args.starts // 4)
        s = starts(backend, n)
        print(f"\n== {name}")
        if name == "bubblewrap":
            floor = bwrap_starts(backend, n)
            print(
                f"bare bwrap (namespaces, /usr, /proc, /dev) python -c pass, no runner: "
                f"p50 {pct(floor, 0.5) * 1000:.1f} ms, p95 {pct(floor, 0.95) * 1000:.1f} ms"
            )
        print(
            f"start (python -c pass, whole execution): p50 {pct(s, 0.5) * 1000:.1f} ms, p95 {pct(s, 0.95) * 1000:.1f} ms ({n} starts)"
        )
        for label, code in (("pandas", PANDAS_TASK), ("stdlib", STDLIB_TASK)):
            t_in, a_in = inside(backend, code, files, args.rounds)
            t_out, a_out = outside(code, files, args.rounds, tmp)
            assert a_in == a_out, (a_in, a_out)
            print(
                f"30,000-row task ({label}): inside {t_in:.3f} s, outside {t_out:.3f} s, "
                f"ratio {t_in / t_out:.2f}x  answer {a_in}"
            )
        total = 40 if name == "bubblewrap" else 12
        print(
            f"parallel: {parallel(backend, args.parallel, total):.1f} executions/s with {args.parallel} at once"
        )
    print(f"\nload at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
