"""The store: LMDB tables, record layouts, checks, rewrites and migrations."""
