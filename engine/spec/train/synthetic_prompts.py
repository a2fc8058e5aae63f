"""Templated chat prompts, to widen self-distillation data beyond the shipped prompt file.

The shipped training prompts are three quarters grade-school maths; an EAGLE3 head trained on
them drafts chat answers poorly. These prompts cross everyday topics with common request
shapes. Topics of the held-out evaluation prompts (bench/prompts/chat_eval.jsonl) are left out.

    python -m engine.spec.train.synthetic_prompts --out FILE [--count N] [--seed S] [--skip N]
"""

import argparse
import json
import random
from pathlib import Path

TEMPLATES = [
    "What is {t}?", "Explain {t} in simple terms.", "Give me three tips about {t}.",
    "What are the pros and cons of {t}?", "Write a short paragraph about {t}.", "How do I get started with {t}?",
    "What are common mistakes people make with {t}?", "Tell me an interesting fact about {t}.",
    "Write a short poem about {t}.", "Summarize the history of {t} in a few sentences.",
    "Why is {t} important?", "Describe {t} to a ten-year-old.", "What should a beginner know about {t}?",
    "Write a friendly message recommending {t} to a friend.", "List five words related to {t}.",
    "How has {t} changed over the last fifty years?", "What questions should I ask before choosing {t}?",
    "Compare {t} with something similar.", "Write a short story that involves {t}.",
    "Can you give me a step-by-step plan for {t}?",
]
TOPICS = [
    "gardening", "composting", "bird watching", "chess", "knitting", "photography", "hiking", "running a marathon",
    "yoga", "meditation", "baking bread", "making coffee", "brewing tea", "vegetarian cooking", "meal planning",
    "budgeting", "saving for retirement", "credit scores", "renting an apartment", "buying a used car",
    "public speaking", "time management", "remote work", "job interviews", "writing a resume", "networking",
    "learning to code", "JavaScript", "databases", "cloud computing", "cybersecurity", "password managers",
    "smartphones", "electric cars", "recycling", "climate change", "renewable energy", "volcanoes", "earthquakes",
    "the rainforest", "deserts", "coral reefs", "dinosaurs", "ancient Rome", "ancient Egypt", "the printing press",
    "the industrial revolution", "the Renaissance", "jazz music", "classical music", "learning the piano",
    "painting with watercolors", "writing a novel", "poetry", "reading habits", "libraries", "museums",
    "traveling on a budget", "packing for a flight", "learning French", "Japanese culture", "the Olympic Games",
    "soccer", "basketball", "swimming", "cycling in a city", "first aid", "drinking enough water", "vitamins",
    "stress", "friendship", "raising a puppy", "cats", "keeping fish", "houseplants", "home organization",
    "cleaning a kitchen", "fixing a leaky faucet", "painting a room", "woodworking", "3D printing", "robots",
    "artificial intelligence", "space exploration", "Mars", "black holes", "telescopes", "weather forecasts",
    "rainbows", "snow", "the human brain", "memory", "dreams", "languages", "mathematics", "fractions",
    "probability", "statistics", "geometry", "chemistry", "magnets", "electricity", "bridges", "skyscrapers",
    "trains", "airplanes", "sailing", "maps", "volunteering", "voting", "small businesses", "marketing",
    "customer service", "negotiation", "teamwork", "leadership", "online learning", "studying for exams",
    "note taking", "handwriting", "board games", "video games", "movies", "podcasts", "news literacy",
    "social media", "birthdays", "weddings", "holidays", "gift giving", "camping cooking", "bees", "whales",
]


# Added later (head v3). Their pairs come after all of the pairs above, so a given --seed still
# yields the same first len(TOPICS) * len(TEMPLATES) prompts as before.
MORE_TEMPLATES = [
    "I'm curious about {t}. Where should I begin?", "Write a short blog post introduction about {t}.",
    "What are five facts everyone should know about {t}?", "Explain {t} using an analogy.",
    "What is a common myth about {t}, and what is the truth?", "Write a haiku about {t}.",
    "What tools or resources do I need for {t}?", "Give me a checklist for {t}.",
    "Write a short dialogue between two friends talking about {t}.", "What would an expert say about {t}?",
]
MORE_TOPICS = [
    "sourdough starters", "houseplant pests", "home insurance", "paying off debt", "investing in index funds",
    "negotiating a salary", "learning guitar", "singing", "drawing portraits", "origami",
    "pottery", "calligraphy", "stamp collecting", "astronomy for beginners", "the solar system",
    "glaciers", "tornadoes", "hurricanes", "rivers", "mountains", "islands", "migrating birds", "butterflies",
    "ants", "elephants", "penguins", "wolves", "horses", "farming", "beekeeping", "urban gardening",
    "fermentation", "making pasta", "grilling", "spices", "chocolate", "cheese", "street food", "table manners",
    "hosting a dinner party", "planning a road trip", "train travel", "backpacking in Europe",
    "visiting a national park", "learning Mandarin", "sign language", "the history of writing",
    "ancient Greece", "the Vikings", "the Silk Road", "medieval castles", "the moon landing", "the Wright brothers",
    "the invention of the telephone", "electric bicycles", "public transport", "city planning", "architecture",
    "interior design", "minimalism", "decluttering", "sustainable fashion", "sewing", "laundry", "moving house",
    "starting a podcast", "starting a blog", "freelancing", "productivity apps", "spreadsheets",
    "web development", "open source software", "computer hardware", "keyboards", "backing up files",
    "online privacy", "phishing emails", "smart homes", "virtual reality", "quantum computers", "nuclear energy",
    "wind turbines", "batteries", "water conservation", "air pollution", "forests", "wetlands", "soil",
    "nutrition labels", "protein", "stretching", "posture", "walking every day", "mindfulness", "journaling",
    "gratitude", "habits", "procrastination", "motivation", "parenting toddlers", "teenagers", "grandparents",
    "pets and children", "adopting a dog", "training a cat", "aquariums", "chess openings", "crossword puzzles",
    "magic tricks", "theater", "opera", "comic books", "fantasy novels", "science fiction", "mystery stories",
]


def synthetic_prompts(count: int, seed: int = 0, skip: int = 0) -> list[str]:
    """`count` prompts after the first `skip` (to draw new ones beyond an earlier run's)."""
    rng = random.Random(seed)
    pairs = [(t, s) for t in TOPICS for s in TEMPLATES]
    rng.shuffle(pairs)
    old = set(pairs)
    more = [(t, s) for t in TOPICS + MORE_TOPICS for s in TEMPLATES + MORE_TEMPLATES if (t, s) not in old]
    rng.shuffle(more)
    return [template.format(t=topic) for topic, template in (pairs + more)[skip : skip + count]]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", type=int, default=0, help="leave out the first SKIP prompts of this seed")
    args = ap.parse_args()
    args.out.write_text("".join(json.dumps({"source": "synthetic/templated", "prompt": p}) + "\n"
                                for p in synthetic_prompts(args.count, args.seed, args.skip)))
