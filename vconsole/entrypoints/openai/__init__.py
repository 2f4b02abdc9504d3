"""`vconsole serve`: an OpenAI-compatible HTTP server, a client of the engine process (vLLM's
``entrypoints/openai/``)."""
