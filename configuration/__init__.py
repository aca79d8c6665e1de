"""Declarative tenant configuration (`manage.py apply FILE.yaml`): the entry points are in apply.py."""
