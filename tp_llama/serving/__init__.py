"""The HTTP front doors, independent of TorchServe: the handler block of the yaml (settings), the rules
every request obeys (request), the native API (native), the OpenAI-compatible API (openai_api: its
fields; openai_reply: its replies; openai_logprobs: its log-probability objects), streamed text
(stream) and the serving metrics (metrics)."""
