"""Rotate the platform's assertion signing key, with an overlap (authority/keys.py)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from authority import keys


class Command(BaseCommand):
    help = "Add a signing key (published now, signing after SIGNING_KEY_LEAD_SECONDS) and retire the old one then"

    def add_arguments(self, parser):
        parser.add_argument(
            "--lead-seconds",
            type=int,
            default=None,
            help="publish this long before signing (default SIGNING_KEY_LEAD_SECONDS; at least twice "
            "JWKS_CACHE_SECONDS, the key set cache bound providers are given)",
        )
        parser.add_argument(
            "--erase-expired",
            action="store_true",
            help="also delete retired keys no assertion can name any more",
        )

    def handle(self, *args, lead_seconds=None, erase_expired=False, **options):
        try:
            key = keys.create_key(lead_seconds=lead_seconds)
        except keys.RotationRefused as exc:
            raise CommandError(f"--lead-seconds: {exc}") from None
        self.stdout.write(
            f"key {key.kid} published; signs from {key.signs_from.isoformat(timespec='seconds')}"
        )
        if erase_expired:
            self.stdout.write(f"erased {keys.erase_expired()} expired key(s)")
