"""Workflow clusters: records, featurizers, batch planning, the offline policy, splits and skills."""
