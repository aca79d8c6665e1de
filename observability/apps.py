from django.apps import AppConfig


class ObservabilityConfig(AppConfig):
    name = "observability"
    verbose_name = "Observability"

    def ready(self) -> None:
        from observability import tracing  # reads settings: only once the apps are loaded

        tracing.configure()
