"""eagle3-console Textual UI: talks to the host only through backend/protocol.py messages."""
