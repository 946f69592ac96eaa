"""Varied prompts for real-model tests (plain text: the Gemma target is a base model)."""

PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time, in a village between two rivers, there lived",
    "Rename the function `add` to `sum_two` and return the code:\n"
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n\nAnswer:\n",
    "List of planets in the solar system: Mercury, Venus, Earth,",
    '{"name": "Ada Lovelace", "born": 1815, "field": "mathematics", "known_for":',
    "Summarise: The river flooded the town twice in one year. The council built a wall. "
    "The wall held during the next flood.\nSummary:",
    "Dear team,\n\nThank you for",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Translate to French: The cat sleeps on the warm windowsill.\nFrench:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]
