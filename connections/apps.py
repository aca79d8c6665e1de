from django.apps import AppConfig


class ConnectionsConfig(AppConfig):
    name = "connections"
    default_auto_field = "django.db.models.BigAutoField"
