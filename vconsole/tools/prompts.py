"""Prompts that read as text, for the load generator on a real model (`vconsole load --prompts
chat`, and the demo whenever its model is not one of the random-weight built-ins).

A small fixed set, written here: short questions and instructions in three topics, one shared
system prompt per topic, and a few long instructions over a passage (they make the engine cut a
prefill into chunks). Every prompt is rendered with the model's own chat template, so a request
reads on the console as what a user typed, and the requests that share a system prompt share
their first tokens: the prefix cache serves those blocks again, as it would a real deployment's
system prompt. A request without a system prompt still shares whatever the template puts first
(SmolLM2's template writes a default system prompt of its own).

Invariant: the drawn sequence depends only on the seed and the set here; the token ids also on the
tokenizer. Each distinct (system, user) pair is rendered once and cached.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

# Short enough that the console's prompt head (200 characters) still reaches the question after
# them; each is a block or two of tokens that every request of its topic shares.
TUTOR = "You are a patient tutor. Explain step by step in plain words, with one short example."
ENGINEER = ("You are a concise assistant for software engineers. Key point first, then short "
            "bullets.")
GUIDE = "You are a friendly cooking and travel guide. Be practical: give quantities and times."

# Each system prompt with the questions it is asked. A request without a system prompt draws
# from all of them.
TOPICS: dict[str, tuple[str, ...]] = {
    TUTOR: (
        "What is the capital of France?",
        "Why is the sky blue?",
        "How do plants make their food?",
        "What causes the seasons on Earth?",
        "Explain what a prime number is.",
        "Why do objects float in water?",
        "What is the difference between weather and climate?",
        "How does the heart pump blood around the body?",
        "Who wrote Romeo and Juliet, and when?",
        "What is photosynthesis? Answer in two sentences.",
        "How many sides does a hexagon have?",
        "Explain gravity to a ten-year-old.",
        "What did the Industrial Revolution change?",
        "Solve for x: 3x + 5 = 20.",
    ),
    ENGINEER: (
        "How do I reverse a list in Python?",
        "What is the difference between a process and a thread?",
        "How do I read a file line by line in Python?",
        "Explain what a hash table is.",
        "What does the git rebase command do?",
        "How can I find which process listens on a port on Linux?",
        "Write a Python function that checks whether a string is a palindrome.",
        "What is a race condition?",
        "When should I use a set instead of a list?",
        "What does HTTP status code 404 mean?",
        "Explain Big O notation in simple terms.",
        "How do I sort a dictionary by its values in Python?",
    ),
    GUIDE: (
        "How do I cook rice on the stove?",
        "What should I pack for a weekend hiking trip?",
        "Give me a simple recipe for pancakes.",
        "How long should I boil an egg for a soft yolk?",
        "What are three things to see in Rome?",
        "How do I make a good cup of tea?",
        "Suggest a vegetarian dinner I can make in thirty minutes.",
        "What is the best way to store fresh herbs?",
        "How can I avoid jet lag on a long flight?",
        "Write a short shopping list for a picnic.",
    ),
}

PASSAGES = (
    "The printing press with movable type, developed in Europe by Johannes Gutenberg around "
    "1440, changed how knowledge spread. Before it, books were copied by hand, which made them "
    "rare and expensive, and a copying error could pass from one copy to the next. Gutenberg "
    "combined several existing ideas: a screw press like those used for wine and olive oil, "
    "metal type cast in a hand mould so that each letter could be reused, and an oil-based ink "
    "that stuck to metal. Within fifty years, printing shops were working in more than two "
    "hundred European towns and millions of books had been printed. Cheaper books helped more "
    "people learn to read, allowed scholars to compare the same text in different cities, and "
    "let new ideas in science and religion travel faster than any authority could control them.",
    "Water on Earth moves in a continuous cycle. The sun heats oceans, lakes and rivers, and "
    "water evaporates into the air as vapour; plants release more vapour through their leaves. "
    "As the warm, moist air rises it cools, and the vapour condenses into tiny droplets that "
    "form clouds. When the droplets join and grow heavy enough, they fall as rain, snow or "
    "hail. Some of that water runs over the ground into streams and rivers and back to the sea, "
    "some soaks into the soil and becomes groundwater that can stay underground for thousands "
    "of years, and some is stored as ice in glaciers and ice caps. The cycle moves heat around "
    "the planet, shapes the land through erosion, and supplies the fresh water that every "
    "living thing on land depends on.",
    "A good code review looks at more than whether the code works. The reviewer first checks "
    "that the change does what its description says and that the tests would fail if it did "
    "not. Then they read for clarity: names that say what a thing is, functions that do one "
    "job, and comments that explain why rather than what. They look for the cases the author "
    "may have missed, such as empty inputs, errors from the network or the disk, and two users "
    "doing the same thing at once. Finally they consider the change as part of the whole "
    "system: whether it duplicates something that already exists, whether it will be easy to "
    "change later, and whether it makes the next person's work simpler or harder. A review is "
    "a conversation, so questions are often more useful than orders.",
)
LONG_INSTRUCTIONS = (
    "Summarize the following passage in two sentences.",
    "List the three most important facts in the passage below.",
    "Write three quiz questions about the passage below, with their answers.",
)
SYSTEM_PROMPTS = tuple(TOPICS)
ALL_QUESTIONS = tuple(q for qs in TOPICS.values() for q in qs)


@dataclass(frozen=True)
class ChatPrompt:
    """One request's messages: an optional system prompt and the user's text."""

    system: str | None
    user: str

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, {"role": "user", "content": self.user}]


def draw_prompt(rng: random.Random, *, long: bool, shared_system: bool) -> ChatPrompt:
    """A prompt from the set: ``long`` an instruction over a passage; ``shared_system`` one of
    the system prompts with a question of its topic, else a question of any topic alone."""
    system = rng.choice(SYSTEM_PROMPTS) if shared_system else None
    if long:
        user = f"{rng.choice(LONG_INSTRUCTIONS)}\n\n{rng.choice(PASSAGES)}"
    else:
        user = rng.choice(TOPICS[system] if system else ALL_QUESTIONS)
    return ChatPrompt(system, user)


class ChatRenderer:
    """A tokenizer's chat template over `ChatPrompt`s, as token ids ready to submit (nothing
    added that the template does not write, as `vconsole serve`'s chat route does). A tokenizer
    without a template gets plain "System:/User:/Assistant:" turns."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[ChatPrompt, list[int]] = {}

    def text(self, prompt: ChatPrompt) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return str(self.tokenizer.apply_chat_template(
                prompt.messages(), tokenize=False, add_generation_prompt=True))
        head = f"System: {prompt.system}\n\n" if prompt.system else ""
        return f"{head}User: {prompt.user}\n\nAssistant:"

    def ids(self, prompt: ChatPrompt) -> list[int]:
        if (ids := self._cache.get(prompt)) is None:
            ids = self._cache[prompt] = list(
                self.tokenizer(self.text(prompt), add_special_tokens=False).input_ids)
        return ids


def load_renderer(model_path: str) -> ChatRenderer:
    """The renderer for the model directory an engine reported (its ``model_path``); ValueError
    when there is no tokenizer there to read."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except Exception as e:
        raise ValueError(f"chat prompts need the model's tokenizer, which could not be read "
                         f"from {model_path!r}: {type(e).__name__}: {e}") from None
    return ChatRenderer(tokenizer)
