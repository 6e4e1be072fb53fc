"""Prior-model targets (ReLA-D): prior registry, precompute, TargetStore, batch PCA."""
