"""Host side: bench."""
