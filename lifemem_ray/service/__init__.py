"""What a front door needs without Ray: API keys, principals, REST models, the MCP tools."""
