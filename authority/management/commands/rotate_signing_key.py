"""Rotate the platform's assertion signing key, with an overlap (authority/keys.py)."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from authority import keys


class Command(BaseCommand):
    help = "Add a signing key (published now, signing after SIGNING_KEY_LEAD_SECONDS) and retire the old one then"

    def add_arguments(self, parser):
        parser.add_argument("--lead-seconds", type=int, default=None, help="publish this long before signing")
        parser.add_argument(
            "--erase-expired",
            action="store_true",
            help="also delete retired keys no assertion can name any more",
        )

    def handle(self, *args, lead_seconds=None, erase_expired=False, **options):
        if lead_seconds is not None and lead_seconds < 0:
            self.stderr.write("--lead-seconds must be 0 or more")
            raise SystemExit(2)
        key = keys.create_key(lead_seconds=lead_seconds)
        self.stdout.write(
            f"key {key.kid} published; signs from {key.signs_from.isoformat(timespec='seconds')}"
        )
        if erase_expired:
            self.stdout.write(f"erased {keys.erase_expired()} expired key(s)")
