"""The console's multi-step actions, one class per key, each holding the app through a narrow protocol (base.py)."""
