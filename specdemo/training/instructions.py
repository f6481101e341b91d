"""The instructions the target answers to write its own training texts: tasks crossed with subjects, drawn with a
seed, so the set is varied, held in the package (no download), and the same on every machine. None of them is among
the benchmarks' prompts, which stay held out."""

from __future__ import annotations

import hashlib
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
    # More kinds of request: a head drafts far better on held-out answers to the kinds it was trained on than on
    # prompts unlike them (docs/recurrent-drafter.md).
    "I'm nervous about {subject}. Can you give me some advice?",
    "Write a short speech for a school assembly about {subject}.",
    "Help me plan a weekend project related to {subject}.",
    "What would change if {subject} disappeared tomorrow?",
    "Write a limerick about {subject}.",
    "Describe {subject} using only simple words.",
    "Write a letter to your future self about {subject}.",
    "Create a short FAQ about {subject}.",
    "Explain {subject} in three sentences.",
    "Write a bedtime story for a five-year-old about {subject}.",
    "What questions should I ask an expert on {subject}?",
    "Is {subject} overrated? Give a balanced opinion.",
    "Write an encouraging message to a friend who is just starting out with {subject}.",
    "Outline a blog post about {subject}.",
    "Describe {subject} to someone who has never seen or heard of it.",
    "Write a short scene for a play that takes place around {subject}.",
    "What ethical questions does {subject} raise?",
    "How does {subject} work? Walk me through it.",
    "Tell me a surprising fact about {subject} and why it is surprising.",
    "Suggest five names for a club devoted to {subject}, with a line about each.",
    "Write a review of an imaginary museum exhibition on {subject}.",
    "Draft a social media post announcing a community event about {subject}.",
    "How would you teach {subject} to your grandparents?",
    "Write a job advertisement for someone who is an expert in {subject}.",
    "What are the first three things to learn about {subject}, and why?",
    "Write a thank-you note to a teacher who got you interested in {subject}.",
    "Imagine {subject} fifty years from now. What has changed?",
    "Write a short mystery story in which {subject} is the key clue.",
    "Write a conversation between two friends who disagree about {subject}.",
    "What are some budget-friendly ways to enjoy {subject}?",
    "How can a family with young children enjoy {subject} together?",
    "Which careers are connected to {subject}? Describe two of them.",
    "Write a slogan and a short pitch for a campaign about {subject}.",
    "Can you help me write a short introduction to {subject} for my presentation?",
    "My friend thinks {subject} is boring. How can I change their mind?",
    "Write a short, funny story about a mix-up involving {subject}.",
    "Give me a checklist for a beginner's first week with {subject}.",
    "What is the most important thing people forget about {subject}?",
    "Write a motivational speech for a team working on {subject}.",
    "Describe how {subject} might look through the eyes of a cat.",
    # Requests as people write them, with their situation or an occasion, so the texts are less like templates.
    "I just started learning about {subject} and I feel lost. Where should I begin?",
    "My partner loves {subject} and I don't get it. Explain it so I can join in the conversation.",
    "Write a short birthday card message for a friend who loves {subject}.",
    "I have to give a five-minute talk on {subject} tomorrow. Give me an outline.",
    "What is a good way to remember the key facts about {subject}?",
    "Explain {subject} with an analogy from cooking.",
    "I'm writing a school report on {subject}. What should it include?",
    "Give me a two-week plan to learn the basics of {subject}.",
    "What are three myths and three facts about {subject}?",
    "Write the opening paragraph of a novel set in a world shaped by {subject}.",
    "Write a cover letter for a volunteer position connected to {subject}.",
    "Describe {subject} the way a sports commentator would.",
    "How does a beginner's view of {subject} differ from an expert's?",
    "Write a rhyming poem for children about {subject}.",
    "My teenager asked me about {subject} and I didn't know the answer. Can you help me explain it?",
    "Write a postcard from a holiday that involved {subject}.",
    "What mistakes do people make when they first try {subject}, and how can they avoid them?",
    "Summarise the main debate around {subject} in a short paragraph.",
    "Describe a simple classroom activity that teaches {subject}.",
    "You are a tour guide. Introduce {subject} to a group of visitors.",
    "Write a short interview with an imaginary expert on {subject}.",
    "What books, films or places would you recommend to someone curious about {subject}?",
    "Write a short story told by a grandparent remembering {subject} from their childhood.",
    "Write an email to my neighbour asking for help with something to do with {subject}.",
    "Make a small table comparing three aspects of {subject}.",
    "Rewrite this in a more formal tone: {subject} is really cool and everybody should try it.",
    "Write a riddle whose answer is {subject}, then explain the clues.",
    "How has {subject} changed in the last hundred years?",
    "What would a scientist say about {subject}, in one short paragraph?",
    "Write the chorus of a song about {subject}.",
    "Why do some people love {subject} while others can't stand it?",
    "I only have ten minutes a day. How can I make progress with {subject}?",
    "Write a short wedding speech for a couple who met through {subject}.",
    "Give me a packing list for a day trip centred on {subject}.",
    "Write a thank-you message to the volunteers who organised an event about {subject}.",
    "What is the biggest open question about {subject} today?",
    "Write a short advertisement for a class on {subject} at the community centre.",
    "Explain {subject} to me like I'm a busy parent with five minutes.",
    "Write a diary entry from the point of view of someone seeing {subject} for the first time.",
    "Can you give me a quick summary of {subject} and one thing I could try this week?",
)

STYLES = (  # a manner asked of some of the instructions, drawn with them: half ask none
    *([""] * 14),
    " Keep it short.",
    " Use simple language.",
    " Use a numbered list.",
    " Be warm and friendly.",
    " Make it a little funny.",
    " Answer in under 150 words.",
    " Give one concrete example.",
    " Write it for a complete beginner.",
    " Use a formal tone.",
    " Avoid jargon.",
    " Use bullet points.",
    " End with a question for the reader.",
    " Keep it to two paragraphs.",
    " Write it for a ten-year-old.",
)

SUBJECTS = tuple(
    " ".join(subject.split())  # one line: a subject wrapped in the list below is one subject
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
    """`count` distinct instructions (at most len(TASKS) * len(SUBJECTS)), in a seeded order, each with a manner
    drawn from STYLES."""
    pairs = [(task, subject) for task in TASKS for subject in SUBJECTS]
    assert 0 < count <= len(pairs), f"between 1 and {len(pairs)} instructions"
    draw = random.Random(seed)
    draw.shuffle(pairs)
    return [task.format(subject=subject) + draw.choice(STYLES) for task, subject in pairs[:count]]


def pool_digest() -> str:
    """A hash of every instruction the package holds: texts written from another pool are another set of texts."""
    return hashlib.blake2b("\n".join(TASKS + SUBJECTS + STYLES).encode(), digest_size=6).hexdigest()
