"""Artifacts: files a run receives (uploads), produces (a tool's CSV, a sandbox's /out) and
passes on (run_python's inputs). Stored once in PostgreSQL with their sha256, readable by
whoever may read the run, shown to the model as a short description and an id."""
