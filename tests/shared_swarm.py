"""The tiny swarm every pytest worker shares (the `tiny_swarm` fixture, tests/fixtures/swarms.py): the number of
blocks of its model (the `tiny_llama` fixture) and the DHT prefix its servers announce that model under."""

TINY_BLOCKS = 4
TINY_PREFIX = "tiny"
