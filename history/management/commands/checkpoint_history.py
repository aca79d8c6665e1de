"""Sign a checkpoint over every run's chain head now (the beat does it every
HISTORY_CHECKPOINT_SECONDS: history/tasks.py)."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from history.checkpoints import take_checkpoint


class Command(BaseCommand):
    help = "Sign a checkpoint (Merkle root over every run's chain head) with the platform's key"

    def handle(self, *args, **options):
        checkpoint = take_checkpoint()
        if checkpoint is None:
            self.stdout.write("no run's head moved since the last checkpoint")
            return
        self.stdout.write(
            f"checkpoint {checkpoint.number}: {checkpoint.size} runs, root {checkpoint.root}, key {checkpoint.kid}"
        )
