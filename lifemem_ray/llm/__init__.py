"""The LLM layer: an OpenAI-compatible client, the memory's prompts, answer checks and the decider."""
