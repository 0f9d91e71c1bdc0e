"""Gateway service: OpenAI- and Anthropic-compatible sessions for agents rollstream did not write."""
