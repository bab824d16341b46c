"""Everything that knows about users: the HTTP, WebSocket and OpenAI-compatible APIs (not built yet)."""
