"""The clip forms over the core: pure and in place, per group, the optimizer hand-over, adaptive and AdaGC state, write-back, the record."""
