"""What apply did, per kind and object, and the error that rejects a file as a whole."""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = (
    "tenant",
    "secrets",
    "groups",
    "users",
    "model_endpoints",
    "tool_servers",
    "tools",
    "grants",
    "agents",
    "versions",
    "aliases",
    "budgets",
    "webhooks",
)


class ConfigError(Exception):
    """The file was rejected as a whole; `errors` lists every (path, message)."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = list(errors)
        super().__init__(
            "\n".join(f"{path}: {message}" if path else message for path, message in self.errors)
        )


# --- report --------------------------------------------------------------------------------------

_RANK = {"unchanged": 0, "updated": 1, "created": 2, "removed": 2}


@dataclass
class ApplyReport:
    """Per kind, what happened to each object (created, updated, unchanged, removed)."""

    tenant: str = ""
    dry_run: bool = False
    outcomes: dict[str, dict[str, str]] = field(default_factory=lambda: {kind: {} for kind in KINDS})
    changes: list[str] = field(default_factory=list)
    drift: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def record(self, kind: str, label: str, outcome: str, fields: list[str] | tuple = ()) -> None:
        seen = self.outcomes[kind]
        # A tool created by discovery and then configured from the file was created, not updated.
        if _RANK[outcome] < _RANK[seen.get(label, "unchanged")]:
            return
        seen[label] = outcome
        if outcome != "unchanged":
            detail = f" ({', '.join(fields)})" if fields else ""
            self.changes.append(f"{outcome} {kind} {label}{detail}")

    def restored(self, kind: str, label: str, fields: list[str]) -> None:
        """Destination or credential fields of a stored object that differed from the file and were
        set back: a change made outside the file (the admin, the database) that apply undid."""
        if fields:
            self.drift.append(
                f"{kind} {label}: {', '.join(fields)} differed from this file and were restored"
            )

    def counts(self, kind: str) -> dict[str, int]:
        values = list(self.outcomes[kind].values())
        return {name: values.count(name) for name in ("created", "updated", "unchanged", "removed")}

    @property
    def changed(self) -> bool:
        return any(outcome != "unchanged" for kind in KINDS for outcome in self.outcomes[kind].values())

    @property
    def state(self) -> str:
        return "dry run, nothing written" if self.dry_run else ("applied" if self.changed else "unchanged")

    def __str__(self) -> str:
        totals = {
            name: sum(self.counts(kind)[name] for kind in KINDS)
            for name in ("created", "updated", "unchanged", "removed")
        }
        return f"tenant {self.tenant}: {self.state} ({', '.join(f'{n} {v}' for n, v in totals.items())})"

    def render(self) -> str:
        lines = [
            f"tenant {self.tenant}: {self.state}",
            f"{'kind':<16}{'created':>8}{'updated':>8}{'unchanged':>10}{'removed':>8}",
        ]
        for kind in KINDS:
            c = self.counts(kind)
            lines.append(f"{kind:<16}{c['created']:>8}{c['updated']:>8}{c['unchanged']:>10}{c['removed']:>8}")
        lines += ["changes:"] + [f"  {line}" for line in self.changes or ["none"]]
        if self.drift:
            lines += ["drift restored (where calls go, which secret they carry):"]
            lines += [f"  {line}" for line in self.drift]
        if self.notes:
            lines += ["notes:"] + [f"  {line}" for line in self.notes]
        return "\n".join(lines)
