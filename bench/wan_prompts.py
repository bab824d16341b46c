"""The WAN benchmark's prompts (bench/wan.py): copy-heavy chats, whose answers copy much of the prompt (what
prompt-lookup speculation drafts from), and free chat (ordinary questions, whose answers copy little)."""

from __future__ import annotations

JSON_RECORD = """{
  "id": 4172,
  "name": "Ada Lovelace",
  "email": "ada@example.org",
  "roles": ["admin", "editor"],
  "address": {"street": "12 St James's Square", "city": "London", "postcode": "SW1Y 4JH"},
  "active": true,
  "last_login": "2026-11-24T18:03:11Z"
}"""

BUGGY_CODE = """def average(numbers):
    total = 0
    for number in numbers:
        total += number
    return total / len(numbers) + 1


def median(numbers):
    ordered = sorted(numbers)
    middle = len(ordered) // 2
    if len(ordered) % 2 == 0:
        return (ordered[middle - 1] + ordered[middle]) / 2
    return ordered[middle]"""

PASSAGE = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
           "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
           "it was the season of Darkness, it was the spring of hope, it was the winter of despair.")

COPY_HEAVY = {
    "json": f"Repeat this JSON exactly, with nothing else:\n\n{JSON_RECORD}",
    "code": f"Fix the bug in `average` and return the whole file, corrected:\n\n```python\n{BUGGY_CODE}\n```",
    "quote": f"Quote this passage back to me word for word:\n\n\"{PASSAGE}\"",
}

FREE_CHAT = {
    "seasons": "Why does the Earth have seasons?",
    "language": "Give me some advice for learning a new language.",
    "bread": "How do I bake a simple loaf of bread at home?",
}

WORKLOADS = {"copy-heavy": COPY_HEAVY, "chat": FREE_CHAT}
