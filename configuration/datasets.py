"""The file's `datasets:` section (docs/evaluations.md): each dataset's cases, stored as its next
version when they differ from its latest (evals.services.save_dataset); errors by path in the file.

    datasets:
      - name: disputes
        description: The dispute story's cases
        cases: [{name: approve-path, input: {...}, user: asha, recordings: [...], checks: [...]}]

Applied after the users it names are written, in the same transaction as the rest of the file.
"""

from __future__ import annotations

from core.errors import DomainError
from evals import services


def read(raw, problems) -> list[dict]:
    """The section's shape; the cases themselves are checked against the database in apply()."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        problems.add("datasets", "a list of datasets")
        return []
    found = []
    for i, item in enumerate(raw):
        where = f"datasets.{i}"
        if not isinstance(item, dict):
            problems.add(where, "a mapping with name and cases")
            continue
        for key in sorted(set(item) - {"name", "description", "cases"}):
            problems.add(f"{where}.{key}", "unknown field")
        if not isinstance(item.get("name"), str) or not services.NAME.match(item["name"]):
            problems.add(f"{where}.name", "letters, digits, - and _ (at most 100)")
            continue
        found.append({**item, "_where": where})
    return found


def apply(tenant, datasets: list[dict], problems, report) -> None:
    for item in datasets:
        where = item["_where"]
        try:
            version, created = services.save_dataset(
                tenant=tenant,
                dataset=item["name"],
                cases=item.get("cases") or [],
                description=str(item.get("description") or ""),
            )
        except DomainError as exc:
            for field, messages in (exc.fields or {"": [exc.message]}).items():
                for message in messages:
                    problems.add(f"{where}.{field}" if field else where, message)
            continue
        if created:
            report.changes.append(
                f"created dataset {item['name']} v{version.number} ({version.cases.count()} cases)"
            )
        else:
            report.notes.append(f"dataset {item['name']}: its cases are v{version.number}'s, unchanged")
