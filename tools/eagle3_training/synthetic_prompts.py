"""Templated chat prompts, to widen self-distillation data beyond the shipped prompt file.

The shipped training prompts are three quarters grade-school maths; an EAGLE3 head trained on
them drafts chat answers poorly. These prompts cross everyday topics with common request
shapes. Topics of the held-out evaluation prompts (bench/prompts/chat_eval.jsonl) are left out.

    python -m tools.eagle3_training.synthetic_prompts --out FILE [--count N] [--seed S] [--skip N]
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


# Added later (head v5), after every pair above for the same reason.
NEW_TEMPLATES = [
    "What is the best way to learn about {t}?", "Explain the basics of {t} in three short paragraphs.",
    "Give me a fun weekend activity related to {t}.", "What are the biggest challenges in {t} today?",
    "Write a short speech about {t}.", "How would you explain {t} to a grandparent?",
    "What are some good books or films about {t}?", "Write a list of dos and don'ts for {t}.",
    "How can {t} save time or money?", "What is the future of {t}?",
    "Write a limerick about {t}.", "What are three questions people often ask about {t}, with answers?",
]
NEW_TOPICS = [
    "kayaking", "rock climbing", "skiing", "surfing", "tennis", "golf", "table tennis", "martial arts",
    "boxing", "skateboarding", "ice skating", "fishing", "hunting for mushrooms", "foraging", "orienteering",
    "scuba diving", "paragliding", "horse riding", "dog sledding", "marathon training plans", "strength training",
    "pilates", "dancing", "ballet", "hip hop", "salsa dancing", "drumming", "the violin", "the guitar amplifier",
    "songwriting", "music theory", "choirs", "folk music", "rock music", "the blues", "film photography",
    "video editing", "animation", "graphic design", "typography", "logo design", "user interface design",
    "color theory", "sculpture", "mosaics", "glass blowing", "leather crafts", "candle making", "soap making",
    "embroidery", "quilting", "crochet", "scrapbooking", "model trains", "kites", "paper airplanes", "puzzles",
    "sudoku", "card games", "poker", "the history of chess", "escape rooms", "amusement parks", "zoos",
    "aquariums for the public", "botanical gardens", "lighthouses at sea", "castles in Scotland", "the Alps",
    "the Amazon river", "the Sahara", "Antarctica", "the Arctic", "Iceland", "New Zealand", "Canada", "Mexico",
    "Brazil", "India", "Kenya", "Egypt today", "Italy", "Spain", "Germany", "Norway", "Korea", "Vietnam",
    "Peru", "Morocco", "the Great Wall of China", "the pyramids", "Stonehenge", "the Eiffel Tower",
    "the Statue of Liberty", "the Roman Colosseum", "the Aztecs", "the Maya", "the Incas", "samurai", "knights",
    "pirates", "explorers", "Marco Polo", "Leonardo da Vinci", "Isaac Newton", "Marie Curie", "Albert Einstein",
    "Charles Darwin", "Ada Lovelace", "Nikola Tesla", "the steam engine", "the light bulb", "the radio",
    "television", "the compass", "the wheel", "paper", "glass", "steel", "plastic", "rubber", "cotton", "wool",
    "silk", "coffee farming", "rice", "wheat", "potatoes", "tomatoes", "apples", "bananas", "honey", "olive oil",
    "soup", "salads", "sandwiches", "pizza", "curry", "sushi", "tacos", "dumplings", "ice cream", "cakes",
    "cookies", "smoothies", "lemonade", "food safety", "leftovers", "freezing food", "canning vegetables",
    "kitchen knives", "cast iron pans", "slow cookers", "air fryers", "microwaves", "dishwashers",
    "washing machines", "vacuum cleaners", "lawn care", "hedges", "tree planting", "bird feeders", "ponds",
    "frogs", "snakes", "lizards", "turtles", "sharks", "octopuses", "jellyfish", "dolphins", "owls", "eagles",
    "parrots", "chickens", "cows", "goats", "sheep", "rabbits", "hamsters", "guinea pigs", "spiders",
    "mosquitoes", "ladybugs", "earthworms", "fungi", "the immune system", "the lungs",
    "bones", "muscles", "skin care", "sunscreen", "teeth", "eyesight", "hearing", "allergies", "colds",
    "headaches", "hydration during sports", "naps", "caffeine", "sugar", "salt", "fiber",
    "calories", "fasting", "cooking for one", "family dinners", "chores for kids", "allowances", "bedtime stories",
    "homework", "school lunches", "field trips", "teachers", "homeschooling", "college applications",
    "scholarships", "student loans", "internships", "apprenticeships", "changing careers", "retirement hobbies",
    "working from a cafe", "office etiquette", "meetings", "giving feedback", "conflict at work",
    "burnout", "work-life balance", "side projects", "selling crafts online", "running a bakery", "food trucks",
    "opening a cafe", "pricing a product", "advertising", "brand names", "customer reviews", "online shopping",
    "returns and refunds", "warranties", "insurance for pets", "taxes", "bank accounts", "credit cards",
    "mortgages", "emergency funds", "charity", "tipping", "the stock market", "cryptocurrency",
    "Linux", "the command line", "Git", "Python", "SQL", "HTML", "CSS", "APIs", "algorithms", "data structures",
    "debugging", "unit testing", "code reviews", "software bugs", "computer viruses", "two-factor authentication",
    "Wi-Fi", "Bluetooth", "GPS", "satellites", "rockets", "the International Space Station", "comets", "asteroids",
    "Jupiter", "Saturn's rings", "the sun", "eclipses", "tides", "ocean currents", "waves", "lakes", "caves",
    "fossils", "crystals", "gold", "diamonds", "sand", "lightning", "fog", "hail", "droughts", "floods",
    "wildfires", "seasons", "time zones", "calendars", "clocks", "measurement units", "percentages", "decimals",
    "algebra", "prime numbers", "multiplication tables", "mental math", "logic puzzles", "physics of sports",
    "gravity", "friction", "sound", "heat", "atoms", "molecules", "acids and bases", "plastic pollution",
]
CODE_TASKS = [
    "reverses a string", "checks whether a word is a palindrome", "counts the vowels in a sentence",
    "removes duplicates from a list while keeping the order", "merges two sorted lists",
    "computes the factorial of a number", "returns the n-th Fibonacci number", "checks whether a number is prime",
    "sums the digits of an integer", "converts Celsius to Fahrenheit", "finds the average of a list of numbers",
    "counts how often each word appears in a text", "capitalizes the first letter of every word",
    "flattens a nested list", "checks whether two strings are anagrams",     "reads a text file and counts its lines", "validates a simple email address", "converts a number to binary",
    "finds the longest word in a sentence", "rotates a list by k positions", "transposes a matrix",
    "computes the greatest common divisor of two numbers", "checks whether a year is a leap year",
    "generates a random password", "sorts a list of dictionaries by a key", "groups words by their first letter",
    "returns the common elements of two lists", "counts the characters in a string without spaces",
    "implements binary search", "implements bubble sort", "removes punctuation from a string",
    "splits a list into chunks of size n", "finds the missing number in a list from 1 to n",
    "converts a dictionary into a list of tuples", "computes compound interest", "checks for balanced parentheses",
    "returns the running total of a list", "calculates the area of a circle", "formats a number with commas",
]
CODE_TEMPLATES = ["Write a Python function that {t}.", "Show me how to write code that {t}, and explain it."]

# Topics of the tiers above that came close to held-out evaluation prompts' own (chat_eval.jsonl:
# focus while studying, weather and climate, a lighthouse keeper's story, a camping trip, a poem
# about the moon). The tiers keep them (earlier heads' data was drawn from them in this order);
# corpora built since leave their prompts out (away_from_held_out). (Coding tasks stay: the two
# held-out Python prompts ask for none of them.)
NEAR_HELD_OUT = ("studying for exams", "climate change", "weather forecasts", "lighthouses at sea",
                 "camping cooking", "the moon landing")


def away_from_held_out(prompts: list[str]) -> list[str]:
    """`prompts` without those about a topic of NEAR_HELD_OUT."""
    return [p for p in prompts if not any(topic in p for topic in NEAR_HELD_OUT)]


def synthetic_prompts(count: int, seed: int = 0, skip: int = 0) -> list[str]:
    """`count` prompts after the first `skip` (to draw new ones beyond an earlier run's)."""
    rng = random.Random(seed)
    pairs = [(t, s) for t in TOPICS for s in TEMPLATES]
    rng.shuffle(pairs)
    old = set(pairs)
    more = [(t, s) for t in TOPICS + MORE_TOPICS for s in TEMPLATES + MORE_TEMPLATES if (t, s) not in old]
    rng.shuffle(more)
    seen = old | set(more)
    newer = [(t, s) for t in TOPICS + MORE_TOPICS + NEW_TOPICS for s in TEMPLATES + MORE_TEMPLATES + NEW_TEMPLATES
             if (t, s) not in seen] + [(t, s) for t in CODE_TASKS for s in CODE_TEMPLATES]
    rng.shuffle(newer)
    return [template.format(t=topic) for topic, template in (pairs + more + newer)[skip : skip + count]]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", type=int, default=0, help="leave out the first SKIP prompts of this seed")
    args = ap.parse_args()
    args.out.write_text("".join(json.dumps({"source": "synthetic/templated", "prompt": p}) + "\n"
                                for p in synthetic_prompts(args.count, args.seed, args.skip)))
