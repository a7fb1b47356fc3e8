"""Host side: serve."""
