"""The instructions the target answers to write its own training texts: tasks crossed with subjects, drawn with a
seed, so the set is varied, held in the package (no download), and the same on every machine. None of them is among
the benchmarks' prompts, which stay held out."""

from __future__ import annotations

import random

TASKS = (
    "Explain {subject} to a curious twelve-year-old.",
    "Write a short story in which {subject} plays a part.",
    "Give five practical tips about {subject}.",
    "What are the most common misconceptions about {subject}?",
    "Write a friendly email inviting a colleague to a workshop on {subject}.",
    "Describe the history of {subject} in a few paragraphs.",
    "Write a poem about {subject}.",
    "Compare {subject} with something from everyday life, and explain the comparison.",
    "List the pros and cons of {subject}.",
    "Write a product description for a book about {subject}.",
    "Answer briefly: why does {subject} matter?",
    "Plan a one-day lesson on {subject} for adult learners.",
    "Write a dialogue between a teacher and a student about {subject}.",
    "Summarise what a beginner should know about {subject} in one paragraph.",
    "Write a news report about a surprising discovery involving {subject}.",
    "Give step-by-step instructions for getting started with {subject}.",
    "Write a persuasive paragraph arguing that everyone should learn about {subject}.",
    "Describe a typical day of someone who works with {subject}.",
    "Write three quiz questions about {subject}, with answers.",
    "Write a diary entry of a traveller who encounters {subject}.",
)

SUBJECTS = tuple(
    subject.strip()
    for subject in """
photosynthesis, the water cycle, volcanoes, black holes, the Roman Empire, bread baking, saving money, learning
a second language, recycling, honeybees, electric cars, the human heart, chess, composting, the printing press,
sleep, climate change, prime numbers, gardening, public libraries, the moon landing, coral reefs, vaccines, jazz
music, bicycles, the internet, ancient Egypt, earthquakes, friendship, time management, rainforests, the piano,
coffee, penguins, solar panels, the Olympic Games, mountain climbing, origami, the French Revolution, cloud
computing, migrating birds, first aid, tea ceremonies, glaciers, robots, democracy, the periodic table,
knitting, sourdough, lighthouses, the stock market, dinosaurs, meditation, the Silk Road, rain, public speaking,
bridges, octopuses, writing a resume, the seasons, magnets, football, Shakespeare, deserts, vitamins, trains,
the immune system, pottery, recycled paper, the Renaissance, wind energy, cats, dogs, photography, maps, the
ocean floor, fermentation, video games, the alphabet, city parks, weather forecasts, kindness, rivers,
satellites, the Great Wall of China, museums, chocolate, open-source software, butterflies, fire safety, the
violin, tides, architecture, password security, apples, board games
""".split(",")
)


def instructions(count: int, seed: int = 0) -> list[str]:
    """`count` distinct instructions (at most len(TASKS) * len(SUBJECTS)), in a seeded order."""
    pairs = [(task, subject) for task in TASKS for subject in SUBJECTS]
    assert 0 < count <= len(pairs), f"between 1 and {len(pairs)} instructions"
    random.Random(seed).shuffle(pairs)
    return [task.format(subject=subject) for task, subject in pairs[:count]]
