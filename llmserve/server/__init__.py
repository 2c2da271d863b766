"""OpenAI-compatible HTTP server over `AsyncLLM`: `llmserve serve`, or `create_app(ServerConfig(...))`."""
