"""The admin's one way of writing a moment (FORMAT_MODULE_PATH): 14 Jan 2025, 09:30, as the
templates and tenants/admin_site.DATETIME_FORMAT write it; Django's English default
("Jan. 14, 2025, 9:30 a.m.") appeared beside it on the same pages."""
