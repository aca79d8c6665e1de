"""The history chain's own CPU on the step path (issue 37; docs/performance.md).

    .venv/bin/python bench/chain_cost.py [--events 4] [--result-bytes 800,4000,40000]

What the chain adds to a step is Python work only (runs/statements.py links the hashes in the
statement that already inserts the events): per event its content digest and its body
(core/chain.py), per content column written the column's digest. This times exactly those calls
on a step's worth of typical events, in CPU time of this process (time.process_time, less moved
by other processes than wall time), for a tool result of each size given, and prints them as a
share of the engine's CPU per step measured by `bench/profile_step.py --floor` (ENGINE_STEP_MS,
12.5 ms on this VM: docs/performance.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")

from core import chain

ENGINE_STEP_MS = float(os.environ.get("ENGINE_STEP_MS", 12.5))


def step_hashing(events: int, result: dict, observation: str) -> None:
    run, at = uuid.uuid4(), dt.datetime.now(dt.UTC)
    content = chain.content_of({"result": result, "observation": observation})
    for seq in range(events):
        data: dict = {"tool": "lookup", "from": "dispatching", "to": "succeeded", "step_kind": "tool"}
        if seq == events - 1:
            data["content"] = content
        digest = chain.content_digest("tool lookup succeeded", data)
        chain.event_body(run, at, "step_succeeded", 3, None, digest)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=4)
    parser.add_argument("--result-bytes", default="800,4000,40000")
    parser.add_argument("--repeat", type=int, default=5000)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()}; engine CPU per step taken as {ENGINE_STEP_MS} ms")
    for size in (int(s) for s in args.result_bytes.split(",")):
        rows = max(1, size // 40)
        result = {"status": "ok", "rows": [{"id": i, "name": "x" * 20} for i in range(rows)]}
        observation = "y" * size
        started = time.process_time()
        for _ in range(args.repeat):
            step_hashing(args.events, result, observation)
        per_step = (time.process_time() - started) / args.repeat * 1000
        print(
            f"result and observation of ~{size} bytes each, {args.events} events: "
            f"{per_step * 1000:.0f} us per step = {100 * per_step / ENGINE_STEP_MS:.1f}% of the engine's step"
        )


if __name__ == "__main__":
    main()
