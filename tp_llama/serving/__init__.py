"""The HTTP front doors, independent of TorchServe: the handler block of the yaml (settings), the rules
every request obeys (request), the native API (native), the OpenAI-compatible API (openai_api),
streamed text (stream) and the serving metrics (metrics)."""
