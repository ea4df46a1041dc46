"""The data model and the rules every layer shares: trajectories, tenants, errors, decisions, import formats."""
