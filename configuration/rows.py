"""What apply does to one stored row: write the fields that differ, and only those."""

from __future__ import annotations

from typing import Any


def assign(obj: Any, values: dict) -> list[str]:
    """Set the fields that differ and save only those, so concurrent changes to others survive.
    Returns the names changed (for the apply report)."""
    changed = [name for name, value in values.items() if getattr(obj, name) != value]
    for name in changed:
        setattr(obj, name, values[name])
    if changed:
        obj.save(update_fields=changed)
    return changed
