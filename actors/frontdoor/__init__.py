"""The REST and MCP front door on Ray Serve: the app, its admission rules, errors and operations."""
