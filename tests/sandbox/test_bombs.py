"""Contract: each resource bomb comes back as the right kind of limit, and the sandbox is gone
afterwards. Every backend must pass it. Limits are test-sized so that the suite stays quick."""

from __future__ import annotations

import os
import threading
import time

import pytest

from sandbox.limits import ADVICE, CPU, FILE_SIZE, MEMORY, OPEN_FILES, OUTPUT, PROCESSES, TIMEOUT, Limits


def _evict(path: str) -> None:
    """Drop the file's unlocked pages from the host's page cache, as memory pressure would."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_memory_bomb_is_stopped_as_memory(backend, run):
    # With the sandbox's own binaries out of the page cache, they are read back from inside the
    # execution's cgroup and charged to it: at the limit the kernel then reclaimed runsc's text
    # instead of killing, and under gVisor the bomb spun until its CPU or wall limit (20 s).
    launcher = backend.runsc if backend.name == "gvisor" else backend.bwrap
    for path in (launcher, backend.python):
        _evict(os.path.realpath(path))
    started = time.monotonic()
    code = "x = []\nwhile True:\n    x.append(bytearray(16 << 20))"
    outcome = run(code, memory_bytes=128 << 20)
    assert outcome.limit == MEMORY, (outcome.exit_code, outcome.stderr[-500:])
    assert outcome.memory_peak_bytes <= (128 << 20) + (4 << 20)
    assert time.monotonic() - started < 5


def test_a_fork_bomb_is_stopped_as_processes(run):
    code = "import os\nwhile True:\n    os.fork()"
    outcome = run(code, processes=32, wall_seconds=5, cpu_seconds=4)
    assert outcome.limit == PROCESSES, (outcome.exit_code, outcome.stderr[-500:])


def test_a_thread_bomb_is_stopped_as_processes(run):
    code = "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()"
    outcome = run(code, processes=32)
    assert outcome.limit == PROCESSES, (outcome.exit_code, outcome.stderr[-500:])


def test_a_busy_loop_is_stopped_as_cpu(run):
    started = time.monotonic()
    outcome = run("while True:\n    pass", cpu_seconds=1, wall_seconds=10)
    assert outcome.limit == CPU
    assert 0.9 <= outcome.cpu_seconds < 2.5
    assert time.monotonic() - started < 5


def test_two_busy_threads_get_one_core(run):
    code = """
import threading, time
def spin():
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        pass
ts = [threading.Thread(target=spin) for _ in range(2)]
[t.start() for t in ts]
[t.join() for t in ts]
"""
    outcome = run(code, cores=0.5, cpu_seconds=5)
    assert outcome.exit_code == 0, outcome.stderr
    # Unlimited, two threads spinning for a second would use two CPU seconds. Half a core allows
    # half of the wall time the sandbox lived, which under gVisor also holds its own start (the
    # sentry's CPU is charged to the same cgroup), so the bound is taken from the wall clock.
    assert outcome.cpu_seconds <= 0.5 * outcome.wall_seconds + 0.1, outcome
    assert outcome.cpu_seconds < 1.2, outcome


def test_sleeping_past_the_wall_clock_is_stopped_as_timeout(run):
    started = time.monotonic()
    outcome = run("import time\ntime.sleep(60)", wall_seconds=1)
    assert outcome.limit == TIMEOUT
    assert time.monotonic() - started < 4


def test_endless_stdout_is_stopped_as_output_and_keeps_a_bounded_tail(run):
    outcome = run("while True:\n    print('x' * 1000)", stdout_bytes=64 * 1024)
    assert outcome.limit == OUTPUT
    assert len(outcome.stdout) <= 64 * 1024


def test_a_huge_file_is_stopped_as_file_size(run):
    code = "f = open('/tmp/huge', 'wb')\nchunk = b'x' * (1 << 20)\nwhile True:\n    f.write(chunk)\n    f.flush()"
    outcome = run(code, tmp_bytes=16 << 20, output_bytes=8 << 20)
    assert outcome.limit == FILE_SIZE, (outcome.exit_code, outcome.stderr[-500:])


def test_filling_tmp_with_small_files_is_stopped_as_file_size(run):
    code = "i = 0\nwhile True:\n    open(f'/tmp/f{i}', 'wb').write(b'x' * 65536)\n    i += 1"
    outcome = run(code, tmp_bytes=8 << 20)
    assert outcome.limit == FILE_SIZE, (outcome.exit_code, outcome.stderr[-500:])


def test_too_much_in_out_is_stopped_as_output(run):
    code = "open('/out/big.bin', 'wb').write(b'x' * (20 << 20))"
    outcome = run(code, output_bytes=4 << 20)
    assert outcome.limit == OUTPUT, (outcome.exit_code, outcome.stderr[-500:])
    many = run("for i in range(50):\n    open(f'/out/f{i}.txt', 'w').write('x')", output_files=5)
    assert many.limit == OUTPUT, (many.exit_code, many.stderr[-500:])
    assert len(many.files) <= 5


def test_exhausting_file_descriptors_is_stopped_as_open_files(run):
    code = "fs = []\ntry:\n    while True:\n        fs.append(open('/dev/null'))\nexcept OSError:\n    print(len(fs))\n    raise"
    outcome = run(code, open_files=64)
    assert outcome.limit == OPEN_FILES, (outcome.exit_code, outcome.stderr[-500:])
    assert int(outcome.stdout) < 64


def test_every_limit_has_advice_the_model_can_act_on():
    for kind, text in ADVICE.items():
        assert len(text) > 40, kind


def test_one_executions_fork_bomb_does_not_stop_anothers(run):
    bomb = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.001)"
    results = {}
    thread = threading.Thread(
        target=lambda: results.setdefault("bomb", run(bomb, slot=0, processes=64, wall_seconds=4))
    )
    thread.start()
    time.sleep(0.3)  # let the bomb fill its cgroup first: the point is the other runs beside it
    started = time.monotonic()
    honest = run("print(sum(range(10**6)))", slot=1, wall_seconds=3)
    took = time.monotonic() - started
    thread.join()
    assert honest.exit_code == 0 and honest.stdout.strip() == b"499999500000", honest.stderr
    assert took < 3
    # Stopped by whichever of its own limits it reached first: 64 forked interpreters can fill
    # the 256 MiB before the process count (seen under gVisor on a loaded machine).
    assert results["bomb"].limit in (PROCESSES, TIMEOUT, CPU, MEMORY)


def test_limits_refuse_unknown_names_and_non_positive_values():
    with pytest.raises(ValueError, match="unknown limits: gpu"):
        Limits.from_dict({"gpu": 1})
    with pytest.raises(ValueError, match="memory_bytes"):
        Limits.from_dict({"memory_bytes": 0})
    assert Limits.from_dict({"memory_bytes": 10 << 30}, cap=Limits()).memory_bytes == 1 << 30
