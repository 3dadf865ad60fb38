"""Writes tiny_corpus.txt: about 300 KB of plain English made by a small procedural grammar.

The text is original (nothing copied), so it can ship with the repository, and it has enough structure (recurring
characters within a story, dialogue, counting, letters, fables with a moral) that a small byte-level GPT visibly
learns it in a minute or two. A private pseudo-random generator (splitmix64) keeps the output byte-identical across
Python versions, which `random.Random` does not promise.

    python examples/data/make_corpus.py [--out examples/data/tiny_corpus.txt] [--bytes 300000] [--seed 1234]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

MASK = (1 << 64) - 1
T = TypeVar("T")


def _words(text: str, sep: str | None = None) -> list[str]:
    """Word lists written space-separated, phrase lists "|"-separated: far shorter than one quoted item a line."""
    return text.split(sep)


NAMES = _words("Pip Mara Tom Ana Bo Lina Oskar Ruth Ivo Nell Sami Teo Wren Edda Finn Kit Juno Ada Milo Rosa")
ANIMALS = _words("fox owl hare badger heron mouse otter crow goat bear wolf cat hedgehog sparrow tortoise beaver")
PEOPLE = _words("baker fisher weaver miller shepherd potter sailor gardener smith teacher")
ADJ = _words("small old quiet curious brave sleepy clever gentle stubborn cheerful shy restless kind proud careful")
THINGS = _words("lantern key map basket boat bell coat kettle book rope ladder drum shell feather stone apple loaf")
THINGS += _words("letter clock compass")
COLOURS = _words("red blue green silver brown yellow white black golden grey")
NUMBERS = _words("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen")
NUMBERS += _words("sixteen seventeen eighteen nineteen twenty")
DAYS = _words("Monday Tuesday Wednesday Thursday Friday Saturday Sunday")
ASKS = _words("asked whispered called wondered")
ANSWERS = _words("said replied answered laughed")
PLACES = _words(
    "in a village by the river|at the edge of a dark forest|on a hill covered in heather|in a harbour town|"
    "in a valley between two mountains|on an island in a grey sea|on a farm at the end of a long road|"
    "in a city of narrow streets|by the shore of a frozen lake|in a meadow full of bees",
    sep="|",
)
GOALS = _words(
    "find the lost {thing}|reach the top of the hill|cross the river before dark|mend the old {thing}|"
    "bring a {thing} to the market|learn the song of the wind|see the sea for the first time|"
    "build a house before winter|carry a message to the next village|count every star in the sky",
    sep="|",
)
TROUBLES = _words(
    "a storm rolled in from the west|the bridge had been washed away|the path split in three|"
    "a fog came down over the fields|the {thing} was too heavy to carry|night fell sooner than expected|"
    "a wide ditch blocked the way|the wind blew the {thing} into a tree",
    sep="|",
)
HELPS = _words(
    "a {adj} {animal} showed {pro} a hidden path|{pro2} remembered what {pro3} grandmother used to say|"
    "a {person} lent {pro} a {thing}|{pro2} waited patiently until morning|{pro2} asked a passing {animal}|"
    "{pro2} tried again, more slowly this time|{pro2} sang to keep {pro3} courage up",
    sep="|",
)
ENDINGS = _words(
    "and from that day on, {name} was never afraid of the dark again.|and everyone in the village came out to see.|"
    "and that is why the {animals} still tell this story.|and {name} slept better that night than ever before.|"
    "and the {thing} is still there, if you look.|and {name} laughed, because it had been easy after all.",
    sep="|",
)
MORALS = _words(
    "Slow and steady often wins.|A friend in need is a friend indeed.|Look before you leap.|"
    "Many hands make light work.|Kindness costs nothing.|Pride comes before a fall.|"
    "Patience is a quiet kind of courage.|Share what you have, and you will have more.",
    sep="|",
)
WEATHER = _words(
    "it rained all day|the sun was warm|a cold wind blew|snow fell softly|the sky was clear|"
    "clouds hung low over the roofs|there was thunder in the evening|the air smelled of rain",
    sep="|",
)
DOINGS = _words(
    "baked bread|fixed the fence|read by the fire|walked to the mill|picked apples|wrote a letter|fed the goats|"
    "painted the door {colour}|mended a net|planted beans",
    sep="|",
)
QUESTIONS = [  # (question, answer)
    ("Where are you going?", "To the market, to sell a {thing}."),
    ("Why are you so {adj} today?", "Because the {animal} came back this morning."),
    ("Have you seen my {thing}?", "I think it is under the {colour} {thing}."),
    ("What time is it?", "Nearly noon, by the old clock."),
    ("Can you help me carry this?", "Of course. Take that end and I will take this one."),
    ("Is it going to rain?", "The swallows are flying low, so I think it will."),
]
IRREGULAR = {"mouse": "mice", "wolf": "wolves", "loaf": "loaves"}


class Rng:
    """splitmix64: tiny, fast, and its sequence for a seed is fixed forever."""

    def __init__(self, seed: int) -> None:
        self.state = seed & MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n  # the modulo bias is irrelevant for picking words

    def pick(self, items: Sequence[T]) -> T:
        return items[self.below(len(items))]

    def chance(self, p: float) -> bool:
        return self.next() < p * (1 << 64)


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def plural(word: str) -> str:
    if word in IRREGULAR:
        return IRREGULAR[word]
    return word + ("es" if word.endswith(("s", "x", "sh", "ch")) else "s")


def count(n: int, word: str) -> str:
    return f"{NUMBERS[n]} {word if n == 1 else plural(word)}"


class Writer:
    def __init__(self, rng: Rng) -> None:
        self.r = rng

    def fill(self, template: str, **fixed: str) -> str:
        """Fill {slots}; named slots keep one value per call, so a story's hero stays the same hero."""
        r = self.r
        values = {
            "thing": r.pick(THINGS),
            "adj": r.pick(ADJ),
            "animal": r.pick(ANIMALS),
            "person": r.pick(PEOPLE),
            "animals": plural(r.pick(ANIMALS)),
            "colour": r.pick(COLOURS),
            "name": r.pick(NAMES),
            "pro": "them",
            "pro2": "they",
            "pro3": "their",
        }
        values.update(fixed)
        return template.format(**values)

    def story(self) -> str:
        r = self.r
        name, animal, adj = r.pick(NAMES), r.pick(ANIMALS), r.pick(ADJ)
        he = r.chance(0.5)
        pro = {"pro": "him" if he else "her", "pro2": "he" if he else "she", "pro3": "his" if he else "her"}
        hero = dict(name=name, animal=animal, animals=plural(animal), **pro)
        goal = self.fill(r.pick(GOALS), **hero)
        out = [f"Once upon a time, {r.pick(PLACES)}, there lived {article(adj)} {animal} named {name}."]
        out.append(f"More than anything, {name} wanted to {goal}.")
        for _ in range(1 + r.below(3)):
            trouble = self.fill(r.pick(TROUBLES), **hero)
            help_ = self.fill(r.pick(HELPS), **hero)
            out.append(f"But {trouble}. Then {help_}.")
        if r.chance(0.5):
            q, a = r.pick(QUESTIONS)
            out.append(f'"{self.fill(q, **hero)}" {r.pick(ASKS)} {name}. "{self.fill(a, **hero)}"')
        out.append(f"In the end {name} managed to {goal}, " + self.fill(r.pick(ENDINGS), **hero))
        return " ".join(out)

    def fable(self) -> str:
        r = self.r
        a, b = r.pick(ANIMALS), r.pick(ANIMALS)
        while b == a:
            b = r.pick(ANIMALS)
        thing = r.pick(THINGS)
        return (
            f"The {a.capitalize()} and the {b.capitalize()}. "
            f"{article(r.pick(ADJ)).capitalize()} {a} found {article(thing)} "
            f"and would not share it. The {b} said nothing and waited. When {r.pick(WEATHER)}, the {a} "
            f"could not carry the {thing} alone, and the {b} helped without a word. Moral: {r.pick(MORALS)}"
        )

    def dialogue(self) -> str:
        r = self.r
        x, y = r.pick(NAMES), r.pick(NAMES)
        while y == x:
            y = r.pick(NAMES)
        lines = []
        for _ in range(2 + r.below(3)):
            q, a = r.pick(QUESTIONS)
            lines.append(f'"{self.fill(q)}" {r.pick(ASKS)} {x}.')
            # Inside quotes an answer's full stop becomes a comma when the attribution follows.
            lines.append(f'"{self.fill(a).removesuffix(".")}," {r.pick(ANSWERS)} {y}.')
            x, y = y, x
        return "\n".join(lines)

    def counting(self) -> str:
        r = self.r
        sentences = []
        for _ in range(3 + r.below(4)):
            a, b = r.below(11), r.below(11)
            thing = r.pick(THINGS)
            if r.chance(0.5):
                sentences.append(f"{count(a, thing).capitalize()} and {count(b, thing)} make {NUMBERS[a + b]}.")
            else:
                hi, lo = max(a, b), min(a, b)
                left = NUMBERS[hi - lo] + (" is" if hi - lo == 1 else " are")
                sentences.append(f"If you have {count(hi, thing)} and give away {NUMBERS[lo]}, {left} left.")
        return " ".join(sentences)

    def diary(self) -> str:
        r = self.r
        start = r.below(7)
        lines = []
        for i in range(2 + r.below(4)):
            day = DAYS[(start + i) % 7]
            lines.append(f"On {day} {r.pick(WEATHER)}. {r.pick(NAMES)} {self.fill(r.pick(DOINGS))}.")
        return " ".join(lines)

    def letter(self) -> str:
        r = self.r
        to, frm = r.pick(NAMES), r.pick(NAMES)
        return (
            f"Dear {to},\nThank you for the {r.pick(COLOURS)} {r.pick(THINGS)}. This week {r.pick(WEATHER)}, "
            f"and I {self.fill(r.pick(DOINGS))}. The {r.pick(ANIMALS)} by the gate has had {NUMBERS[2 + r.below(6)]} "
            f"young ones. Come and visit when the roads are dry.\nWith love,\n{frm}"
        )


def make_corpus(n_bytes: int = 300_000, seed: int = 1234) -> str:
    w = Writer(Rng(seed))
    kinds = [w.story, w.story, w.story, w.fable, w.dialogue, w.counting, w.diary, w.letter]
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        part = w.r.pick(kinds)()
        parts.append(part)
        size += len(part) + 2
    return "\n\n".join(parts) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).with_name("tiny_corpus.txt")))
    ap.add_argument("--bytes", type=int, default=300_000, help="stop after at least this many bytes")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    text = make_corpus(args.bytes, args.seed)
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {len(text.encode())} bytes to {args.out}")


if __name__ == "__main__":
    main()
