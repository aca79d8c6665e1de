"""The index of pauses given an end time, for the sweeper's pass that resumes them
(runs/pausing.resume_due); partial, so it is empty while no such pause exists (issue 24)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0013_kill_switches"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="run",
            index=models.Index(
                condition=models.Q(("paused_until__isnull", False), ("status", "paused")),
                fields=["paused_until"],
                name="run_pause_ends",
            ),
        ),
    ]
