"""Training metrics: the record schema, the whole-history series index, the grokking signals (standard library only)."""
