"""The tiny swarm every pytest worker shares (the `tiny_swarm` fixture, tests/fixtures/swarms.py): the number of
blocks of its model (the `tiny_llama` fixture), the DHT prefix its servers announce that model under, and the
names of the LoRA adapters both its servers apply (the `tiny_adapters` fixture)."""

TINY_BLOCKS = 4
TINY_PREFIX = "tiny"
TINY_ADAPTERS = ("tiny-lora-attn", "tiny-lora-mlp")
