from django.apps import AppConfig


class AuthorityConfig(AppConfig):
    name = "authority"
    default_auto_field = "django.db.models.BigAutoField"
