"""Templated chat prompts, to widen self-distillation data beyond the shipped prompt file.

The shipped training prompts are three quarters grade-school maths; an EAGLE3 head trained on
them drafts chat answers poorly. These prompts cross everyday topics with common request
shapes. Topics of the held-out evaluation prompts (bench/prompts/chat_eval.jsonl) are left out.

    python -m engine.spec.train.synthetic_prompts --out FILE [--count N] [--seed S]
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


def synthetic_prompts(count: int, seed: int = 0) -> list[str]:
    pairs = [(t, s) for t in TOPICS for s in TEMPLATES]
    random.Random(seed).shuffle(pairs)
    return [template.format(t=topic) for topic, template in pairs[:count]]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.out.write_text("".join(json.dumps({"source": "synthetic/templated", "prompt": p}) + "\n"
                                for p in synthetic_prompts(args.count, args.seed)))
