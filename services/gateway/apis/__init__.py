"""The gateway's API layer, free of I/O: the OpenAI Chat Completions, OpenAI Responses and Anthropic
Messages wire formats parsed into one canonical request (`canonical.ChatRequest`), and generations
rendered back as each API's response body or server-sent event stream."""
