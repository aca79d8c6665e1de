"""The import graph of the product's apps: module circles, app circles, the ladder of rooms and the
arrows that run back up it, function-level imports.

    python scripts/imports.py            print a report (--apps adds each app's arrows, --up each
                                         arrow that runs back up with the imports behind it)
    python scripts/imports.py --check    exit 1 on a module circle, an app circle, an arrow back up
                                         the ladder that BACK_UP does not list, or a function-level
                                         import with no reason written next to it

The ladder (LADDER, bottom to top) is the apps' order, with one room of its own below the gateways:
the run's records (`runs.models`, `runs.controls.models`, `runs.statements`, `runs.selectors`: the
rows every gateway reads and the named statements that write them), apart from the engine and the
run's writes and surfaces above them. An arrow is any import from one room into another (module
level or not, models, views and wiring included); it runs back up when its target sits higher.
Each such arrow is listed in BACK_UP with its reason, so a new one fails the check.

Apps form a ladder with no circle (the wiring modules, which name every app, the surfaces, and
imports of an app's `models`, aside): `runs` (the
engine and run lifecycle) sits above the gateways, approvals and budgets, which decide and never
write run state; `configuration` (declarative tenant configuration) imports every app and is
imported by none. Surfaces (an app's `api` and `admin`: views) may call upward, into the room that
writes (approvals' decide view calls runs.approval_effects.decide_approval); services may not. Module circles
count everywhere. tests/test_architecture.py asserts the check.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top: the ground floor imports no app; the project package on top names every app.
PACKAGES = [
    "core",
    "vault",
    "sandbox",
    "observability",
    "tenants",
    "agents",
    "budgets",
    "llm",
    "connections",
    "tools",
    "approvals",
    "authority",
    "runs",
    "regions",
    "artifacts",
    "notifications",
    "history",
    "evals",
    "configuration",
    "agentplatform",
]
LADDER = [
    "core",
    "vault",
    "sandbox",
    "tenants",
    "agents",
    "runs.records",
    "regions.records",
    "observability",
    "budgets",
    "artifacts",
    "llm",
    "connections",
    "tools",
    "approvals",
    "authority",
    "runs",
    "regions",
    "notifications",
    "history",
    "evals",
    "configuration",
    "agentplatform",
]
RECORDS = {"runs.models", "runs.controls.models", "runs.statements", "runs.selectors"}
# The arrows that still run back up, each with why; a new one fails --check (tests/test_architecture.py).
BACK_UP = {
    (
        "agents",
        "approvals",
    ): "a version's approval overrides are checked as Cedar rules when it is made (approvals.tool_rules)",
    ("agents", "llm"): "a version's spec is checked against the tenant's model endpoints when it is made",
    ("agents", "tools"): "a version's spec is checked against the tenant's tools when it is made",
    (
        "connections",
        "tools",
    ): "a connection is to a tool server (its foreign key and the server's OAuth metadata)",
    ("connections", "runs"): "the OAuth callback view resumes the runs that waited for the connection",
    (
        "tools",
        "approvals",
    ): "a call's digest and the approval bound to it (approvals.calls) are checked at dispatch",
    ("tools", "authority"): "a dispatch check reads the server's delegation (authority.models)",
    ("approvals", "runs"): "the inbox and the decide API apply a decision to the run (runs.approval_effects)",
}


# Settings, URLs, the admin site and the Celery app are wiring: they name every app by design.
WIRING = {
    "agentplatform.urls",
    "agentplatform.celery",
    "agentplatform.settings",
    "agentplatform.asgi",
    "agentplatform.wsgi",
    "tenants.admin_site",
}


def modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        base = ROOT / pkg
        if not base.is_dir():
            continue
        for path in base.rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            if "migrations" in rel.parts or "management" in rel.parts:
                continue
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def resolve(name: str, known: dict[str, Path]) -> str | None:
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(mod: str, path: Path, known: dict[str, Path]):
    """Yield (target module, line, at module level, reason given)."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]

    def visit(node, top: bool, guarded: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False, guarded)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                visit(child, top, True)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    yield_ = resolve(alias.name, known)
                    if yield_:
                        out.append((yield_, child.lineno, top, guarded or _reason(lines, child.lineno)))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in child.names:
                    target = resolve(f"{base}.{alias.name}", known) or resolve(base, known)
                    if target and target != mod:
                        out.append((target, child.lineno, top, guarded or _reason(lines, child.lineno)))
            else:
                visit(child, top, guarded)

    out: list = []
    visit(tree, True, False)
    return out


def _is_type_checking(test) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _reason(lines: list[str], lineno: int) -> bool:
    here = lines[lineno - 1]
    above = lines[lineno - 2].strip() if lineno >= 2 else ""
    return "#" in here or above.startswith("#")


def graph():
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    packages: dict[str, set[str]] = {p: set() for p in PACKAGES}
    problems: list[str] = []
    for mod, path in sorted(known.items()):
        for target, line, top, reason in imports(mod, path, known):
            if not top and not reason:
                problems.append(
                    f"{path.relative_to(ROOT)}:{line}: function-level import of {target} without a reason next to it"
                )
            edges[mod].add(target)
            src, dst = mod.split(".")[0], target.split(".")[0]
            # An app's models are the shared vocabulary (foreign keys, reads), and so are the rooms
            # of records below the gateways (room()); they do not make the importing app depend
            # on the app's behaviour, so they draw no arrow between apps.
            shared = target.endswith(".models") or room(target).endswith(".records")
            if mod not in WIRING and not _surface(mod) and src != dst and not shared:
                packages[src].add(dst)
    return edges, packages, problems


def room(mod: str) -> str:
    if mod in RECORDS:
        return "runs.records"
    # Where a tenant runs and what this region knows of its home (read by the engine), and the
    # signed call to the home (regions.client, on regions.models and regions.signing alone:
    # a run start on a stale copy asks the home, as a tool call's keeper does).
    if mod in ("regions.models", "regions.client", "regions.signing"):
        return "regions.records"
    return mod.split(".")[0]


def back_up() -> dict[tuple[str, str], list[str]]:
    """Every arrow from a room to one above it in LADDER, with the imports behind it."""
    known = modules()
    floor = {name: i for i, name in enumerate(LADDER)}
    found: dict[tuple[str, str], list[str]] = {}
    for mod, path in sorted(known.items()):
        for target, _line, _top, _reason in imports(mod, path, known):
            src, dst = room(mod), room(target)
            if src != dst and floor[dst] > floor[src]:
                found.setdefault((src, dst), []).append(f"{mod} -> {target}")
    return found


def _surface(mod: str) -> bool:
    """Views (API and admin): entry points that may call the room that writes, wherever it sits."""
    return mod.rpartition(".")[2] in ("api", "admin")


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(edges):
        if v not in index:
            strong(v)
    return out


def main() -> int:
    edges, packages, problems = graph()
    found = circles(edges)
    for comp in found:
        problems.append(f"import circle of {len(comp)} modules: {', '.join(comp)}")
    for comp in circles(packages):
        problems.append(f"import circle of {len(comp)} apps: {', '.join(comp)}")
    up = back_up()
    for (src, dst), behind in sorted(up.items()):
        if (src, dst) not in BACK_UP:
            problems.append(f"{src} -> {dst} runs back up the ladder: {', '.join(sorted(set(behind)))}")
    arrows = sum(len(v) for v in edges.values())
    print(
        f"{len(edges)} modules, {arrows} arrows, {len(found)} module circles, "
        f"{len(up)} arrows back up the ladder, {len(problems)} problems"
    )
    if "--up" in sys.argv:
        for (src, dst), behind in sorted(up.items()):
            print(f"  {src} -> {dst}: {BACK_UP.get((src, dst), 'NOT LISTED')}")
            for line in sorted(set(behind)):
                print(f"      {line}")
    if "--apps" in sys.argv:
        for pkg in PACKAGES:
            print(f"  {pkg} -> {', '.join(sorted(packages[pkg])) or '-'}")
    for p in problems:
        print("  " + p)
    return 1 if ("--check" in sys.argv and problems) else 0


if __name__ == "__main__":
    raise SystemExit(main())
