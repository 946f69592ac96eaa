"""Many varied training prompts from modest tables: templates × topics × styles over seven categories
(chat, code, editing, summarising, json, stories, multi-turn), drawn by a seed.

A prompt is a ``TrainPrompt``: its category and its turns (user, assistant, ..., user; one turn
for all categories but multi-turn), the form ``features.chat_tokens`` renders. ``generate_prompts``
keeps only prompts that share no ``data.NGRAM``-word sequence with the evaluation texts (bench
tasks, tests/real_prompts.py) or with ``prompts.HELDOUT_PROMPTS``, so no future template can leak
what the heads are measured on; tests/test_train_data.py checks the output too.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

from edgespec.train.data import Forbidden, evaluation_texts
from edgespec.train.prompts import HELDOUT_PROMPTS

CATEGORIES = ("chat", "code", "editing", "summarising", "json", "stories", "multi-turn")


class TrainPrompt(NamedTuple):
    """A generated training prompt: ``category`` (one of ``CATEGORIES``) and ``turns``."""

    category: str
    turns: tuple[str, ...]


TOPICS = (
    "tide pools", "the history of paper", "hot air balloons", "mushroom foraging", "lighthouses", "rain gauges",
    "kite flying", "the metric system", "bread yeast", "subway maps", "honey badgers", "origami", "sundials",
    "bird migration", "fountain pens", "thunderstorms", "board game design", "snow tyres", "street food",
    "the telescope", "crop rotation", "electric guitars", "caves", "sea turtles", "budget travel", "typography",
    "first aid kits", "river deltas", "cheese making", "marathon training", "public parks", "the compass",
    "home insulation", "penguins", "olive oil", "ancient Egypt", "night photography", "carpooling", "bonsai trees",
    "museum curation", "tea ceremonies", "traffic lights", "cloud formation", "the abacus", "knitting",
    "sand dunes", "birdwatching", "vinyl records", "rock climbing", "lunar eclipses", "urban gardening",
    "the lymphatic system", "maple syrup", "paper airplanes", "invasive plant species", "open source software",
    "keyboard shortcuts", "time zones", "data backups", "noise-cancelling headphones",
)
STYLES = (
    "in plain words", "for a complete beginner", "as a numbered list", "in under eighty words",
    "using an everyday analogy", "in a formal tone", "in a playful tone", "for a busy manager",
    "with one concrete example", "as a short question-and-answer list",
)
CHAT = (
    "Explain {t} {s}.", "What should everyone know about {t}? Answer {s}.", "Why does {t} matter? Reply {s}.",
    "Give me three surprising facts about {t}, {s}.", "Compare {t} with {u}, {s}.",
    "What are common mistakes people make with {t}? Answer {s}.", "How did {t} change over time? Tell me {s}.",
    "I'm curious about {t}. Could you describe it {s}?",
)
LANGS = ("Python", "JavaScript", "TypeScript", "Go", "Rust", "C", "Java", "Ruby", "Kotlin", "C#")
TASKS = (
    "reverses the words in a sentence", "merges two sorted lists", "counts word frequencies in a text",
    "checks an email address with a simple rule", "computes the median of a list of numbers",
    "removes duplicate items while keeping their order", "converts Celsius to Fahrenheit",
    "flattens a nested list", "checks whether two strings are anagrams",
    "finds the longest common prefix of several strings", "parses a date written as YYYY-MM-DD",
    "rotates a square matrix by 90 degrees", "keeps a running average of incoming numbers",
    "groups records by a key", "splits a list into chunks of size n", "finds the second largest number",
    "capitalises the first letter of each word", "computes the greatest common divisor of two integers",
    "tests whether a number is prime", "counts the lines of a text file", "retries a failing call with backoff",
    "caches the results of an expensive function", "reads key=value lines from a config file",
    "builds a histogram of word lengths", "transposes a table of rows", "computes a simple checksum of bytes",
    "formats a number of seconds as hours and minutes", "finds all pairs in a list that sum to a target",
    "validates balanced brackets in a string", "converts a Roman numeral to an integer",
)
CODE = (
    "Write a {l} function that {k}.", "In {l}, how would you write code that {k}? Include a short explanation.",
    "Show a {l} snippet that {k}, with comments.", "Write unit tests in {l} for a function that {k}.",
    "Which edge cases matter for a {l} function that {k}? Then write it.",
    "Write a {l} function that {k}, and state its time complexity.",
)
FLAWED = (
    "me and my friend was reading about {t} and it were really interesting",
    "{t} is very important for alot of people because they helps us every day",
    "i dont really understand {t}, can somebody explains it to me",
    "Their are many reason why {t} have become so popular recently",
    "The report about {t} was wrote by our team last week and it need review",
    "we should of learned more about {t} before we buyed all that equipment",
    "Honestly {t} is kind of boring but also it is kind of fun i guess",
    "The committee have decided that {t} will be discussed on the next meeting",
)
EDITS = (
    "Fix the grammar and spelling in this sentence: \"{x}\"", "Rewrite this sentence in a formal tone: \"{x}\"",
    "Make this sentence clearer and shorter: \"{x}\"", "Rewrite this sentence so it sounds friendly: \"{x}\"",
    "Correct the mistakes, then explain each change: \"{x}\"", "Proofread this line from an email: \"{x}\"",
    "Turn this into a polished sentence for a newsletter: \"{x}\"", "Give two better versions of this sentence: \"{x}\"",
)
FACTS = (
    "{T} has a longer history than most people assume.", "Interest in {t} grew quickly over the last decade.",
    "Local groups now meet every month to talk about {t}.", "Critics say the cost of {t} is often underestimated.",
    "Supporters argue that {t} saves time and money in the long run.",
    "A recent survey found that few people could explain {t} accurately.",
    "Schools have started to include {t} in their lessons.", "The weather and the season both affect {t}.",
    "Experts disagree about how {t} will change in the coming years.",
    "Several small businesses have been built around {t}.", "Beginners usually need a few weeks to get used to {t}.",
    "Safety rules for {t} differ from one country to another.",
)
SUMMARIES = (
    "Summarise the following paragraph in one sentence:\n\n{x}", "Give a two-bullet summary of this note:\n\n{x}",
    "What is the main point of this text?\n\n{x}", "Write a headline for this paragraph:\n\n{x}",
    "Summarise this for a ten-year-old:\n\n{x}", "List the key claims made in this passage:\n\n{x}",
)
ENTITIES = (
    "a book", "a city", "a recipe", "a laptop", "a movie", "an employee", "a planet", "a concert",
    "a bank transaction", "a weather report", "a flight", "a restaurant", "a pet", "a music album",
    "a hiking trail", "a product review", "a job posting", "a calendar event", "a used car", "an online course",
)
FIELDS = ("name", "id", "created_at", "tags", "price", "rating", "location", "description", "owner", "status",
          "duration", "category")
JSON = (
    "Return a JSON object describing {e} with the fields {f}.",
    "Create a JSON array of three example records for {e}, each with {f}.",
    "Write a JSON schema for {e} that has the properties {f}.",
    "Output only valid JSON: {e} with keys {f}, using realistic values.",
    "Design a compact JSON format for {e}; it must include {f}. Show one example.",
)
CHARACTERS = (
    "a retired sailor", "a shy librarian", "a talking fox", "a young inventor", "a grumpy baker", "two rival chefs",
    "a lost astronaut", "a travelling musician", "a clockmaker's apprentice", "a curious owl", "an old shepherd",
    "a city pigeon", "a detective who hates rain", "a girl who collects maps", "a forgetful wizard", "a taxi driver",
)
SETTINGS = (
    "in a snowed-in mountain village", "on a floating market", "in an abandoned greenhouse", "during a power cut",
    "on the last day of summer", "inside a giant clock tower", "on a ferry crossing a foggy bay",
    "in a desert town with one well", "at a midnight train station", "in a library that never closes",
    "on a tiny island", "at a chaotic wedding",
)
TWISTS = (
    "and nothing goes as planned", "and an old promise must be kept", "and a strange key appears",
    "and the weather becomes a character", "and a stranger knows their name", "and it ends with a surprise gift",
    "and they must work with an enemy", "and time seems to run backwards",
)
STORIES = (
    "Write a short story about {c} {p}, {w}.", "Tell a bedtime story about {c} {p}, {w}.",
    "Write a six-sentence story about {c} {p}, {w}.", "Write the opening paragraph of a novel about {c} {p}, {w}.",
    "Write a fable about {c} {p}, {w}, with a moral at the end.", "Tell a story as diary entries by {c} {p}, {w}.",
)
ANSWERS = (
    "Sure. {T} is a broad subject, so here is a short overview to start with.",
    "Happy to help. In short, {t} is easier to understand once you see a few examples.",
    "Good question. The key idea behind {t} is simpler than it first looks.",
)
FOLLOW_UPS = (
    "Can you make that shorter?", "Give me a concrete example, please.", "Now explain it as a list of steps.",
    "What would an expert add to that?", "Thanks! Can you turn that into a quiz question?",
    "How does that compare with {u}?", "Could you say it again for a child?", "What are the main risks or downsides?",
)


def _chat(r: random.Random) -> tuple[str, ...]:
    t, u = r.sample(TOPICS, 2)
    return (r.choice(CHAT).format(t=t, u=u, s=r.choice(STYLES)),)


def _code(r: random.Random) -> tuple[str, ...]:
    return (r.choice(CODE).format(l=r.choice(LANGS), k=r.choice(TASKS)),)


def _editing(r: random.Random) -> tuple[str, ...]:
    return (r.choice(EDITS).format(x=r.choice(FLAWED).format(t=r.choice(TOPICS))),)


def _summarising(r: random.Random) -> tuple[str, ...]:
    t = r.choice(TOPICS)
    facts = sorted(r.sample(range(len(FACTS)), 4))
    text = " ".join(FACTS[i].format(t=t, T=t[0].upper() + t[1:]) for i in facts)
    return (r.choice(SUMMARIES).format(x=text),)


def _json(r: random.Random) -> tuple[str, ...]:
    f = r.sample(FIELDS, 3)
    return (r.choice(JSON).format(e=r.choice(ENTITIES), f=f"{f[0]}, {f[1]} and {f[2]}"),)


def _stories(r: random.Random) -> tuple[str, ...]:
    return (r.choice(STORIES).format(c=r.choice(CHARACTERS), p=r.choice(SETTINGS), w=r.choice(TWISTS)),)


def _multi_turn(r: random.Random) -> tuple[str, ...]:
    t, u = r.sample(TOPICS, 2)
    first = r.choice(CHAT).format(t=t, u=u, s=r.choice(STYLES))
    answer = r.choice(ANSWERS).format(t=t, T=t[0].upper() + t[1:])
    return first, answer, r.choice(FOLLOW_UPS).format(u=u)


_MAKERS: dict[str, Callable[[random.Random], tuple[str, ...]]] = {
    "chat": _chat, "code": _code, "editing": _editing, "summarising": _summarising, "json": _json,
    "stories": _stories, "multi-turn": _multi_turn,
}


def heldout_forbidden() -> Forbidden:
    """The n-grams training prompts must avoid: the evaluation texts' and the held-out prompts'."""
    return Forbidden([*evaluation_texts(), *HELDOUT_PROMPTS])


def generate_prompts(n: int = 7000, seed: int = 0, forbidden: Forbidden | None = None) -> list[TrainPrompt]:
    """``n`` distinct prompts, the categories in turn (``CATEGORIES``), reproducible for a seed.

    Args:
        n: how many.
        seed: the draw.
        forbidden: a prompt whose turns it does not call clean is skipped (default: ``heldout_forbidden()``).

    Raises:
        ValueError: the tables cannot give ``n`` distinct clean prompts.
    """
    forbidden = forbidden or heldout_forbidden()
    r = random.Random(seed)
    seen: set[tuple[str, ...]] = set()
    out: list[TrainPrompt] = []
    tries = 0
    while len(out) < n:
        category = CATEGORIES[len(out) % len(CATEGORIES)]
        turns = _MAKERS[category](r)
        tries += 1
        if tries > 50 * n + 1000:
            raise ValueError(f"the prompt tables give only {len(out)} distinct clean prompts (asked for {n})")
        if turns in seen or not forbidden.clean("\n".join(turns)):
            continue
        seen.add(turns)
        out.append(TrainPrompt(category, turns))
    return out
