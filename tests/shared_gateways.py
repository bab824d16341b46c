"""How the two gunicorn gateways that the e2e tests share are configured (the `gateway` and `strict_gateway`
fixtures, tests/e2e/conftest.py): the tests that check a limit read it here."""

# `gateway`: a small cap on sessions and a short idle timeout
TINY_MAX_SESSIONS = 6
TINY_MAX_SESSION_LENGTH = 1024  # the tiny tokenizer spends a token on nearly every character
TINY_IDLE_TIMEOUT = 3.0
TINY_HEADER_TIMEOUT = 3.0  # HTTP_HEADER_TIMEOUT: tests/e2e/test_slow_clients.py waits it out
# its embedding models (EMBEDDING_MODELS, tests/tiny_encoder.py), served under these folder names: one normalizes
TINY_ENCODER, TINY_RAW_ENCODER = "tiny-encoder", "tiny-encoder-raw"

# `strict_gateway`: API keys, an origin allowlist, small limits
STRICT_KEYS = ("key-access", "key-body", "key-context", "key-sessions", "key-other", "key-rate", "key-ws-rate",
               "key-ws", "key-logs", "key-browser", "key-anthropic", "key-ollama", "key-work", "key-work-slots",
               "key-store-a", "key-store-b", "key-owner-a", "key-owner-b", "key-silent")  # one per test: the per-client limits count by key
STRICT_ORIGIN = "https://chat.example"
STRICT_CONTEXT = 64  # the model's max_session_length
STRICT_LIMITS = {"MAX_SESSIONS_PER_CLIENT": 2, "REQUESTS_PER_MINUTE": 40, "WS_IDLE_TIMEOUT": 3, "MAX_BODY_BYTES": 8192,
                 "WS_MAX_MESSAGE_BYTES": 4096, "MAX_NEW_TOKENS": 16,
                 "MAX_INPUTS_PER_REQUEST": 4, "MAX_INPUT_TOKENS_PER_REQUEST": 100, "MAX_STORED_RESPONSES": 4}
