"""Between phases 1 and 2: every URL the file gives a tool server, a model endpoint or a webhook
must be on a host the tenant allows (`tenant.egress_hosts`), checked before discovery contacts any server.

The list comes from the file, or else from the tenant as stored; none anywhere means no
restriction. A server or endpoint outside the list is an error at its URL's path and is left out,
so nothing of the file is applied. Servers and endpoints already stored but not in this file are
checked too (an error at `tenant.egress_hosts`): a narrower list must not leave them reaching out.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from configuration.schema import Plan, Problems
from llm.models import ModelEndpoint
from notifications.models import Webhook
from tenants.models import Tenant
from tools.models import ToolServer
from tools.origins import OriginError, host_allowed

# (section, the URL's key in the file, model field, model)
_TARGETS = (
    ("tool_servers", "url", "url", ToolServer),
    ("model_endpoints", "base_url", "base_url", ModelEndpoint),
    ("webhooks", "url", "url", Webhook),
)


def check_egress(plan: Plan, problems: Problems) -> None:
    if plan.tenant is None:
        return
    stored = Tenant.objects.filter(slug=plan.tenant.key).first()
    if "egress_hosts" in plan.tenant.values:
        allowed = plan.tenant.values["egress_hosts"]
    else:
        allowed = stored.egress_hosts if stored else None
    if allowed is None:
        return
    for section, key, field, model in _TARGETS:
        listed = set()
        for item in list(plan.sections.get(section, [])):
            listed.add(item.key)
            url = item.values.get(field)  # always set: phase 1 fills omitted destinations with defaults
            if url and not _allowed(url, allowed):
                problems.add(f"{item.path}.{key}", f"host is not in tenant.egress_hosts ({_host(url)})")
                plan.sections[section].remove(item)
                plan.drop(section, item.key)
        if stored is None:
            continue
        for name, url in (
            model.objects.filter(tenant=stored).exclude(**{field: ""}).values_list("name", field)
        ):
            if name not in listed and not _allowed(url, allowed):
                problems.add(
                    "tenant.egress_hosts",
                    f"{section[:-1].replace('_', ' ')} {name!r} (stored, not in this "
                    f"file) reaches {_host(url)}, which the list does not allow",
                )


def _allowed(url: str, allowed: list[str]) -> bool:
    try:
        return host_allowed(url, allowed)
    except OriginError:
        return False


def _host(url: str) -> str:
    try:
        return urlsplit(url).netloc.rpartition("@")[2] or url
    except ValueError:
        return url
