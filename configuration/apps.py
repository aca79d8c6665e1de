from django.apps import AppConfig


class ConfigurationConfig(AppConfig):
    """Declarative tenant configuration: parse, discover, write, report (`manage.py apply`)."""

    name = "configuration"
