"""DSA attention for GLM-5: indexer top-k, IndexShare, and the sparse-MLA backends."""
