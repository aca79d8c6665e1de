from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Run the dispute story end to end on the embedded defaults and print its timeline."

    def add_arguments(self, parser):
        parser.add_argument("--file", default="examples/dispute.yaml")

    def handle(self, *args, **options):
        from examples.dispute_demo import run_demo

        raise SystemExit(run_demo(config_path=options["file"], out=self.stdout))
