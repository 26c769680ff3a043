"""Decisions over the request state machine, one policy a module:
residency, parking, retain-on-retract (PD decode), streaming."""
