"""Wrap every run's content key with the first of CONTENT_KEYS (vault/sealing.py): run it after
putting a new key in front, then remove the old one (docs/history.md, "Sealed content")."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from vault import sealing


class Command(BaseCommand):
    help = "Rewrap every run's content key with the first of CONTENT_KEYS, so that the others can be retired"

    def handle(self, *args, **options):
        try:
            rewrapped, current = sealing.rewrap_all()
        except sealing.KeyStoreUnavailable as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"rewrapped {rewrapped} run keys; {current} were wrapped by the first key already")
