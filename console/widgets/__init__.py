"""Widgets the screens are built from: connection banner, GPU bars, panels, curve plots."""
