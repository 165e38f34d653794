"""Sentence sets the conversion benchmark embeds, no download: two styles, so a conversion fitted on one is judged
on the other.

* :func:`varied_sentences`: technical prose, the first sentence of the docstrings of a fixed list of Python
  standard-library modules' functions and classes (the conversions run on some of them, the rest are held out);
* :func:`everyday_sentences`: everyday English written for this benchmark, unlike that prose in register and
  subject: spoken questions, news headlines (no final stop) and casual remarks, directions and recipe steps,
  a third of the set each.
"""

from __future__ import annotations

#: The standard-library modules :func:`varied_sentences` reads.
MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "csv", "datetime",
    "decimal", "difflib", "email", "fractions", "functools", "gzip", "heapq", "html", "http.client", "json",
    "logging", "mailbox", "math", "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3",
    "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "time", "turtle", "unittest",
    "urllib.parse", "uuid", "wave", "zipfile",
)  # fmt: skip

QUESTIONS = (
    "Where did you park the car when we got to the stadium last night?",
    "How long should I boil an egg if I want the yolk still runny?",
    "Is the pharmacy on Elm Street open on Sunday afternoons?",
    "Why does my cat knock every glass off the kitchen table?",
    "Can you recommend a good novel for a long train ride?",
    "What time does the last bus leave for the airport?",
    "Do you think it will snow before the end of the week?",
    "Who painted the mural on the side of the old bakery?",
    "How much does it cost to send a parcel to Canada?",
    "Did anyone remember to water the tomatoes while I was away?",
    "Which road is faster to the coast at this time of day?",
    "Should I bring a jacket to the concert tonight?",
    "What happened to the dog that used to sleep on the porch?",
    "How do you say thank you in Portuguese?",
    "Are the children allowed to swim in the lake after dark?",
    "Is grandma's birthday party on Saturday or on Sunday?",
    "Could you help me carry these boxes up to the third floor?",
    "What's the best way to get red wine out of a white shirt?",
    "Why is the queue at the post office so long today?",
    "Have you ever climbed the hill behind the church?",
    "How many eggs do we need for the pancakes?",
    "Is it true that the museum is free on the first Monday of the month?",
    "What did the doctor say about your sore knee?",
    "Where can I buy fresh fish around here?",
    "Would you rather live by the sea or in the mountains?",
    "How did the football team manage to lose that game?",
    "Can I borrow your umbrella until tomorrow morning?",
    "What are you cooking for dinner, it smells wonderful?",
    "Why did the power go out in the whole neighbourhood?",
    "Does this train stop at the central station?",
    "Who is looking after the baby while you are at work?",
    "How far is the beach from the hotel on foot?",
)

HEADLINES = (
    "Storm leaves thousands without power along the northern coast",
    "Local bakery wins national prize for its sourdough bread",
    "City council approves new bicycle lanes downtown",
    "Heatwave expected to break records across the south this weekend",
    "Village celebrates as the old bridge reopens after two years",
    "Schoolchildren plant five hundred trees in the park",
    "Price of coffee rises for the third month in a row",
    "Rescue team finds missing hikers safe on the mountain",
    "Home side snatches late victory in the derby",
    "Farmers warn that the dry spring will hurt the harvest",
    "New ferry service links the two islands from June",
    "Museum returns stolen painting to its rightful owners",
    "Teenager sets a national record in the hundred metres",
    "Flooding closes the main road into town for a second day",
    "Hospital opens a new children's ward after years of fundraising",
    "Festival crowds enjoy music and sunshine by the river",
    "Train drivers announce strike over summer timetable",
    "Rare bird spotted in a suburban garden draws hundreds of watchers",
    "Mayor promises cheaper buses for students and pensioners",
    "Fire at the old cinema is under control, say firefighters",
    "Tourists flock to the coast as schools close for the holidays",
    "Supermarket chain to cut plastic packaging by half",
    "Orchestra plays a free concert in the town square",
    "Fishermen report the best catch in a decade",
    "Snowfall brings traffic to a halt on the motorway",
    "Library extends opening hours during exam season",
    "Veteran actor returns to the stage after a long illness",
    "Wildfire forces the evacuation of three villages",
    "Local team reaches the cup final for the first time",
    "Power cut delays flights at the regional airport",
    "Police appeal for witnesses after a crash on the ring road",
    "Volunteers clear tons of rubbish from the beach",
)

REMARKS = (
    "I can't believe how cold it got after the sun went down.",
    "My brother finally fixed the leaking tap in the bathroom.",
    "We laughed so hard at dinner that my sides still hurt.",
    "Honestly, the second season of that show was much better than the first.",
    "She always sings in the car when her favourite song comes on.",
    "The kids spent the whole afternoon building a fort out of pillows.",
    "I missed the train by a minute and had to wait an hour for the next one.",
    "Our neighbours are having a barbecue and the smoke is drifting into the garden.",
    "Don't forget to lock the back door before you go to bed.",
    "He ordered the spicy noodles and regretted it after the first bite.",
    "The puppy chewed through my favourite pair of shoes.",
    "It rained all day, so we stayed in and played board games.",
    "My grandmother makes the best apple pie in the whole world.",
    "I think I left my keys at the café this morning.",
    "The traffic was terrible, but we still made it on time.",
    "We're planning a picnic by the lake if the weather holds.",
    "Rub the butter into the flour until it looks like breadcrumbs.",
    "Turn left at the petrol station and the house is the third on the right.",
    "Add a pinch of salt and let the soup simmer for twenty minutes.",
    "The baby finally fell asleep after an hour of rocking.",
    "My phone died halfway through the call with my sister.",
    "They painted the kitchen bright yellow and it looks amazing.",
    "I've been learning the guitar, but my fingertips really hurt.",
    "The new teacher is strict, but the students seem to like her.",
    "We walked along the harbour and watched the boats come in.",
    "Sorry I'm late, the bus broke down on the way here.",
    "The shop had run out of milk, so I bought juice instead.",
    "Every summer we rent a small cottage near the sea.",
    "He tripped over the cat and spilled coffee all over the carpet.",
    "Can't wait to see everyone at the wedding next month!",
    "The garden looks lovely now that the roses are in bloom.",
    "After the match we all went out for pizza to celebrate.",
)


def varied_sentences(count: int, skip: int = 0) -> list[str]:
    """``count`` distinct English sentences of 6-30 words from :data:`MODULES`' docstrings (technical prose on many
    subjects), after the first ``skip``."""
    import importlib
    import inspect

    seen, sentences = set(), []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for _, member in sorted(vars(module).items()):
            doc = inspect.getdoc(member) if callable(member) else None
            if not doc:
                continue
            first = " ".join(doc.split("\n\n")[0].split()).split(". ")[0].strip().rstrip(".")
            words = len(first.split())
            if 6 <= words <= 30 and first not in seen and "(" not in first[:20]:
                seen.add(first)
                sentences.append(first + ".")
    if len(sentences) < skip + count:
        raise SystemExit(f"only {len(sentences)} sentences found, {skip + count} asked for")
    return sentences[skip : skip + count]


def everyday_sentences(count: int | None = None) -> list[str]:
    """The first ``count`` (None: all 96) everyday sentences, the three kinds interleaved (a question, a headline,
    a remark, ...), so any prefix holds each kind."""
    every = [s for triple in zip(QUESTIONS, HEADLINES, REMARKS) for s in triple]
    count = len(every) if count is None else count
    if count > len(every):
        raise SystemExit(f"only {len(every)} everyday sentences, {count} asked for")
    return every[:count]


__all__ = ["MODULES", "everyday_sentences", "varied_sentences"]
