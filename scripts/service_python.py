"""Give SERVE_USER a Python it can run, without opening the directory this one lives in.

Run by scripts/serve.sh (as root) when the service user cannot run `$PY` where it is: the usual
case is an interpreter under /root (pyenv, a root-only home, mode 0700). Opening /root to the
service user would show it every readable file there; instead this builds, under a directory the
service user can reach, a tree of hard links to exactly what the platform runs:

| under `<dest>/` | what | from |
|---|---|---|
| `base/` | the interpreter, its shared library and standard library | `sys.base_prefix`, without its own site-packages (the virtualenv does not use them) |
| `venv/` | the virtualenv: its packages; `bin/python` points at `base/`, `pyvenv.cfg` names `base/bin` | `sys.prefix` |
| `app/` | the checkout's code, templates and examples (only when asked: a checkout the user cannot read) | the current directory, without `.git`, `.venv` and `var` |

Hard links cost no space and no copying, and keep each file's owner and mode: the service user
reads what it could read before, and can change none of it. Across file systems (where a link
cannot be made) each file is copied instead. A stamp records what the tree was built from; a
tree whose stamp matches is used as it is, so a restart costs nothing. The interpreter's RUNPATH
still names the original directory: serve.sh puts `base/lib` on LD_LIBRARY_PATH for the services.

Prints the python the service user runs (`<dest>/venv/bin/python`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

# Not code: caches and tools' databases (Hypothesis writes its examples into .hypothesis/ as tests
# run; bytecode is compiled again from the sources), so writing them rebuilds nothing.
SKIP_APP = {
    ".git",
    ".venv",
    "var",
    "node_modules",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
    "__pycache__",
}


def link_tree(source: Path, dest: Path, skip=lambda path: False) -> None:
    """`dest` becomes a tree of hard links to `source`'s files (copies across file systems)."""
    for root, dirs, files in os.walk(source):
        here = Path(root)
        dirs[:] = [d for d in dirs if not skip(here / d)]
        target = dest / here.relative_to(source)
        target.mkdir(parents=True, exist_ok=True)
        shutil.copystat(here, target)
        for name in files:
            src = here / name
            if skip(src):
                continue
            if src.is_symlink():
                os.symlink(os.readlink(src), target / name)
                continue
            try:
                os.link(src, target / name)
            except OSError:  # another file system, or a file the kernel will not link
                shutil.copy2(src, target / name)
        for name in dirs:  # a symlink to a directory is listed in dirs and not walked
            if (here / name).is_symlink():
                os.symlink(os.readlink(here / name), target / name)
        dirs[:] = [d for d in dirs if not (here / d).is_symlink()]


def stamp(app: Path | None) -> str:
    """What the tree is built from: interpreter, virtualenv, their packages and the code's state."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    parts = [sys.base_prefix, sys.prefix, version]
    for path in (
        Path(sys.base_prefix) / "lib" / f"python{version}",
        Path(sys.prefix) / "lib" / f"python{version}" / "site-packages",
    ):
        parts.append(str(path.stat().st_mtime_ns))
    if app is not None:
        # Code edited since the last build: rebuilt (a deployment's checkout rarely changes).
        newest = 0
        for root, dirs, files in os.walk(app):
            dirs[:] = [d for d in dirs if d not in SKIP_APP]
            for name in [*files, *dirs]:
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime_ns)
        parts += [str(app), str(newest)]
    return "\n".join(parts) + "\n"


def build(dest: Path, app: Path | None) -> Path:
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    python = dest / "venv" / "bin" / "python"
    wanted = stamp(app)
    if (dest / "stamp").exists() and (dest / "stamp").read_text() == wanted:
        return python
    base, venv = Path(sys.base_prefix), Path(sys.prefix)
    if base == venv:
        sys.exit(f"{sys.executable} is not in a virtualenv: service_python copies a virtualenv")
    fresh = dest.with_name(dest.name + ".new")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    fresh.chmod(0o755)
    base_packages = base / "lib" / f"python{version}" / "site-packages"
    link_tree(base, fresh / "base", skip=lambda p: p == base_packages)
    (fresh / "base" / "lib" / f"python{version}" / "site-packages").mkdir(exist_ok=True)
    link_tree(venv, fresh / "venv")
    interpreter = Path(os.path.realpath(sys.executable)).name  # python3.11
    for link in (fresh / "venv" / "bin").iterdir():
        if link.is_symlink() and link.name.startswith("python"):
            link.unlink()
            link.symlink_to(dest / "base" / "bin" / interpreter)
    config = fresh / "venv" / "pyvenv.cfg"
    lines = [
        f"home = {dest / 'base' / 'bin'}" if line.startswith("home =") else line
        for line in config.read_text().splitlines()
        if not line.startswith(("executable =", "command ="))
    ]
    config.unlink()  # a hard link to the original: replaced, not written through
    config.write_text("\n".join(lines) + "\n")
    if app is not None:
        link_tree(app, fresh / "app", skip=lambda p: bool(SKIP_APP & set(p.relative_to(app).parts)))
    (fresh / "stamp").write_text(wanted)
    shutil.rmtree(dest, ignore_errors=True)
    fresh.rename(dest)
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path, help="where the tree is built (reachable by the service user)")
    parser.add_argument("--app", type=Path, help="also link this checkout's code, under <dest>/app")
    args = parser.parse_args()
    print(build(args.dest.absolute(), args.app.absolute() if args.app else None))


if __name__ == "__main__":
    main()
