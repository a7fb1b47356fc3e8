"""The host agent: one process per console connection, speaking backend.protocol on stdin/stdout (standard library only)."""
