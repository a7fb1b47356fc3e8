"""Watching runs this tool did not start: TensorBoard event files, SpecForge and plain-text logs (standard library only)."""
