"""The sandbox runner: model-written Python runs here, in a process of its own, never in a worker.

The runner (sandbox/runner.py, `python -m sandbox.runner`) holds no database, broker or tenant
secret: it imports nothing of Django, starts with a cleared environment, and takes code, input
files and limits over loopback HTTP. Each execution gets a fresh sandbox from a backend
(sandbox/backends.py: bubblewrap with a seccomp filter and a cgroup per execution; gVisor's
runsc), and answers with the exit, the tails of its output, the files it left in /out and the
usage measured from outside. DESIGN.md section 11 and docs/sandbox.md state what is isolated.
"""
