"""The ground floor: what every app stands on (errors, SQL helpers, digests, parsers, money, the
environment's readers, the broker's transport). It imports no app of this project, so nothing here
can pull a room above it into a circle; `agentplatform/` (settings, URLs, the admin site, the
Celery app) is the project package on top that names every app."""
