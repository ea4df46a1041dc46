"""The vector index: FAISS search per scope, its cache files and IVF training."""
