"""Limits of one execution, the kinds of limit an execution can hit, and what the model is told.

Defaults are DESIGN.md section 11's: wall 30 s, CPU 20 s, one core, 1 GiB, 64 processes,
/tmp 64 MiB, outputs 32 MiB in at most 20 files, 256 KiB of stdout (and of stderr).
"""

from __future__ import annotations

import dataclasses
from typing import Any

MiB = 1024 * 1024

TIMEOUT = "timeout"
CPU = "cpu"
MEMORY = "memory"
OUTPUT = "output"
FILE_SIZE = "file_size"
PROCESSES = "processes"
OPEN_FILES = "open_files"
KINDS = (TIMEOUT, CPU, MEMORY, OUTPUT, FILE_SIZE, PROCESSES, OPEN_FILES)

ADVICE = {
    TIMEOUT: "the code ran past its wall-clock limit: do less per call (sample, filter first) or "
    "split the input and call run_python once per part",
    CPU: "the code used up its CPU seconds: use vectorised pandas/numpy operations instead of "
    "Python loops, or process the input in chunks over several calls",
    MEMORY: "the code ran out of memory: read the input in chunks (pandas read_csv(chunksize=...)), "
    "keep only the columns you need, or split the input",
    OUTPUT: "the output was too large: print a summary instead of whole tables, and write at most "
    "the allowed number and size of files to /out",
    FILE_SIZE: "a file grew past the size limit (or /tmp is full): write smaller files, or "
    "summarise before writing",
    PROCESSES: "the code started too many processes or threads: do the work in one process",
    OPEN_FILES: "the code opened too many files at once: close files when done with them",
}


@dataclasses.dataclass(frozen=True)
class Limits:
    wall_seconds: float = 30.0
    cpu_seconds: float = 20.0
    cores: float = 1.0
    memory_bytes: int = 1024 * MiB
    processes: int = 64
    tmp_bytes: int = 64 * MiB
    output_bytes: int = 32 * MiB
    output_files: int = 20
    stdout_bytes: int = 256 * 1024
    open_files: int = 256

    @classmethod
    def from_dict(cls, data: dict | None, *, cap: Limits | None = None) -> Limits:
        """Limits from a request; unknown names and non-positive values are refused, and each
        value is held to `cap` (the runner's ceiling) where one is given."""
        data = dict(data or {})
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"unknown limits: {', '.join(unknown)}")
        values: dict[str, Any] = {}  # each a float or an int, as its field is
        for name, value in data.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"limit {name} must be a positive number, not {value!r}")
            values[name] = float(value) if fields[name] == "float" else int(value)
        limits = cls(**values)
        if cap is not None:
            limits = dataclasses.replace(
                limits, **{n: min(getattr(limits, n), getattr(cap, n)) for n in fields}
            )
        return limits

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
