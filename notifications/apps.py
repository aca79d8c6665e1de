from django.apps import AppConfig


class NotificationsConfig(AppConfig):
    """Signed webhooks for supervisors: approval requested or expiring, run needs attention."""

    name = "notifications"
