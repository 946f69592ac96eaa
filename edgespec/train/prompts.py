"""Project-written prompts whose greedy continuations by the target become training data
(self-distillation). Written for training only: no bench task (edgespec/bench/suite/*.jsonl) or test prompt
(tests/real_prompts.py) is reused, and tests/test_train_data.py checks that none shares an 8-word
sequence with them. ``HELDOUT_PROMPTS`` are never trained on: they measure acceptance."""

from __future__ import annotations

TRAIN_PROMPTS: tuple[str, ...] = (
    "Explain in a few sentences how a bicycle gear system makes climbing hills easier.",
    "Write a short Python function that counts the vowels in a string, with a docstring.",
    "What are three good habits for keeping a kitchen tidy during a busy week?",
    "Describe the water cycle to a ten-year-old.",
    "Give me a list of five indoor plants that tolerate low light, with one tip for each.",
    "Write a limerick about a cat who learned to use a laptop.",
    "How does a hash table handle two keys that land in the same bucket?",
    "Summarize the main causes of inflation in simple terms.",
    "Write a polite email asking a neighbour to trim a hedge that blocks the footpath.",
    "When should a Python program use a tuple instead of a list?",
    "Tell a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain what a binary search does and why it is fast.",
    "Suggest a simple weekly meal plan for a vegetarian student on a budget.",
    "Why do leaves change colour in autumn?",
    "Write a SQL query that returns the ten customers with the largest total orders.",
    "Describe how to change a flat tyre on a car, step by step.",
    "What are the pros and cons of working from home?",
    "Write a JavaScript function that debounces another function.",
    "Explain the rules of chess for the knight and the bishop.",
    "Give three tips for writing clear commit messages.",
    "How do vaccines train the immune system?",
    "Write a haiku about the first snow of winter.",
    "Explain recursion with an example that computes a factorial.",
    "What should I pack for a three-day hiking trip in the mountains?",
    "Describe the plot of a mystery novel set on a night train, in one paragraph.",
    "How does compound interest work? Give a worked example.",
    "Write a bash one-liner that finds the five largest files in a directory tree.",
    "What is photosynthesis and why does it matter for life on Earth?",
    "Write a short dialogue between a baker and a customer who wants a birthday cake.",
    "Explain the difference between weather and climate.",
    "List the planets of the solar system with one fact about each.",
    "How can I improve my sleep without medication?",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Explain what an API is to someone who does not program.",
    "Describe a sunrise over the sea in vivid language.",
    "What are the main differences between TCP and UDP?",
    "Give advice to someone preparing for their first job interview.",
    "Write a recipe for a quick tomato soup.",
    "Explain how a refrigerator keeps food cold.",
    "Write a C function that reverses a string in place.",
    "What is the role of the mitochondria in a cell?",
    "Describe three ways to reduce plastic waste at home.",
    "Write a short poem about an old library.",
    "How do I read a CSV file with pandas and compute the mean of one column?",
    "Explain the idea of supply and demand with an example from a farmers' market.",
    "Write a thank-you note to a teacher at the end of the school year.",
    "What causes the tides in the ocean?",
    "Explain what Git branches are and when to use them.",
)

# More chat-shaped data: every subject asked about in several ways (the held-out subjects are not among them).
_SUBJECTS = (
    "volcanoes", "the printing press", "electric cars", "coral reefs", "the Roman aqueducts", "solar panels",
    "public libraries", "sourdough bread", "the stock market", "black holes", "recycling glass",
    "the human heart", "wind turbines", "chess openings", "the Great Wall of China", "earthquakes",
    "coffee roasting", "the violin", "desert animals", "password managers", "rainbows", "bicycle helmets",
    "the moon landing", "composting", "spreadsheets", "jazz music", "glaciers", "the postal service",
    "a sorting algorithm", "unit tests", "regular expressions", "a REST endpoint", "a Python dictionary",
    "a queue data structure", "a shell script", "a makefile",
)
_ASKS = (
    "Explain {s} to a curious teenager in one paragraph.",
    "Write three short bullet points of facts about {s}.",
    "What is a common misconception about {s}, and what is the truth?",
    "Write a four-line poem about {s}.",
    "Give a step-by-step beginner's guide related to {s}.",
    "Write a short, friendly paragraph for a blog post about {s}.",
)
TRAIN_PROMPTS = TRAIN_PROMPTS + tuple(a.format(s=s) for s in _SUBJECTS for a in _ASKS)

HELDOUT_PROMPTS: tuple[str, ...] = (
    "Explain how a microwave oven heats food.",
    "Write a Python function that checks whether a word is a palindrome.",
    "Give four tips for learning a new language as an adult.",
    "Tell a short story about a robot that wants to become a gardener.",
    "What is the difference between RAM and disk storage?",
    "Describe how bees make honey.",
    "Write a short note inviting friends to a picnic on Saturday.",
    "Explain what a linked list is and how to insert an element into it.",
)
