"""Host side: train."""
