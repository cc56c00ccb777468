"""Fixtures of tests/tasks: the shared `taskset` lives in tests/conftest.py (tests/rollout uses it too)."""
