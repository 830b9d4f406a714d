"""Build the broad prompt set that tools/record_llama_exact.py runs through llama.cpp.

The prompts are drawn, with a fixed seed, from text found on a Debian machine (licences, Python's standard
library, C headers, package documentation) plus hand-written multilingual sentences, chat conversations and
generated numbers and symbols, so that nothing in the set was tuned against either engine. Lengths run from a
few tokens to past 1,500, so prompts cross Gemma's 512-token window and the 512-token batch.

    python tools/exact_prompts.py tests/fixtures/exact_prompts.json.gz

Each entry: {"id", "kind", "text"} for raw text, or {"id", "kind": "chat", "messages"} for a conversation that
the recorder renders with the model's own chat template.
"""
import argparse
import glob
import gzip
import json
import os
import random
import sysconfig

LICENCES = "/usr/share/common-licenses"
STDLIB = sysconfig.get_paths()["stdlib"]

MULTILINGUAL = [
    "Le petit prince s'assit sur une pierre et leva les yeux vers le ciel. « Je me demande, dit-il, si les étoiles "
    "sont éclairées afin que chacun puisse un jour retrouver la sienne. »",
    "Die Straßenbahn fuhr langsam durch die verschneite Altstadt, und an jeder Haltestelle stiegen müde Menschen "
    "mit Einkaufstüten ein. Übermorgen beginnt der Weihnachtsmarkt.",
    "En un lugar de la Mancha, de cuyo nombre no quiero acordarme, vivía un hidalgo de los de lanza en astillero, "
    "adarga antigua, rocín flaco y galgo corredor.",
    "A cidade acordou cedo: os pescadores já tinham voltado do mar e as varinas apregoavam sardinhas frescas "
    "nas ruas estreitas de Alfama.",
    "Nel mezzo del cammin di nostra vita mi ritrovai per una selva oscura, ché la diritta via era smarrita.",
    "床前明月光，疑是地上霜。举头望明月，低头思故乡。这首诗是李白写的，几乎每个中国孩子都会背。",
    "人工知能の研究は、この十年で大きく進歩しました。しかし、小さなモデルを手元のノートパソコンで動かすことは、まだ簡単ではありません。",
    "서울의 겨울은 춥지만 맑은 날이 많다. 아침마다 편의점에서 따뜻한 커피를 사서 지하철을 탄다.",
    "Мороз и солнце; день чудесный! Ещё ты дремлешь, друг прелестный — пора, красавица, проснись.",
    "Η Αθήνα είναι μία από τις αρχαιότερες πόλεις του κόσμου, με ιστορία που ξεπερνά τα τρεις χιλιάδες χρόνια.",
    "كان الجو حارًا في السوق القديم، والباعة ينادون على التمر والتوابل والقماش الملون.",
    "בבוקר הלכנו לשוק הכרמל וקנינו פירות טריים, לחם חם וגבינה מקומית.",
    "भारत एक विशाल देश है जहाँ सैकड़ों भाषाएँ बोली जाती हैं और हर राज्य की अपनी संस्कृति है।",
    "Bugün hava çok güzel; sahilde yürüyüş yaptık ve çay bahçesinde simit yedik.",
    "Hôm nay trời mưa to, nên chúng tôi ở nhà đọc sách và uống trà nóng.",
    "วันนี้อากาศดีมาก เราไปเดินเล่นที่สวนสาธารณะและกินไอศกรีมกัน",
    "Wczoraj wieczorem oglądaliśmy mecz w małej kawiarni przy rynku; wszyscy krzyczeli, gdy padł gol.",
    "Watoto walicheza mpira uwanjani hadi jua lilipozama, kisha wakarudi nyumbani kwa chakula cha jioni.",
    "Kuningas käski kutsua kaikki kylän ihmiset juhlaan, ja pöydät notkuivat ruuasta.",
    "Het regende de hele dag in Amsterdam, maar de fietsers trokken zich er niets van aan.",
    "Svenska barn lär sig simma tidigt, eftersom landet har tusentals sjöar och en lång kust.",
    "Ο καφές 🍵, το τσάι ☕ και η σοκολάτα 🍫 — emoji mixed with text: 👩‍💻 writes code, 🚀 ships it, 🎉 celebrates.",
    "Українська мова має багату історію; її літературна форма склалася в дев'ятнадцятому столітті.",
    "Tiếng Việt, 中文, 日本語, 한국어, English and Français in one line: mixing scripts is common on the web.",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of Australia?"}],
    [{"role": "user", "content": "Write a haiku about a cat sleeping in the sun."}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Translate to French: I would like two coffees, please."}],
    [{"role": "user", "content": "List three prime numbers greater than 100."},
     {"role": "assistant", "content": "101, 103 and 107."},
     {"role": "user", "content": "And three more after those?"}],
    [{"role": "user", "content": "Explain what a hash table is to a ten-year-old."}],
    [{"role": "user", "content": "Fix this Python: def add(a, b) return a + b"}],
    [{"role": "user", "content": "给我讲一个关于月亮的简短故事。"}],
    [{"role": "user", "content": "What's 17 times 23? Show your working."}],
    [{"role": "system", "content": "You help people plan meals."},
     {"role": "user", "content": "I have eggs, spinach, and feta. What can I cook for dinner?"}],
    [{"role": "user", "content": "Summarise the plot of Romeo and Juliet in two sentences."}],
    [{"role": "user", "content": "Is a tomato a fruit or a vegetable?"},
     {"role": "assistant", "content": "Botanically it is a fruit; in cooking it is treated as a vegetable."},
     {"role": "user", "content": "So can I put it in a fruit salad?"}],
    [{"role": "user", "content": "Write a SQL query that counts orders per customer in a table orders(id, customer_id)."}],
    [{"role": "user", "content": "Quelle est la différence entre « savoir » et « connaître » ?"}],
    [{"role": "user", "content": "Give me a regular expression that matches an ISO 8601 date."}],
    [{"role": "user", "content": "Tell me a joke about programmers."}],
]


def _paragraphs(text, min_chars=80):
    parts = [" ".join(p.split()) for p in text.split("\n\n")]
    return [p for p in parts if len(p) >= min_chars]


def _read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _licence_texts():
    return {name: _read(os.path.join(LICENCES, name)) for name in sorted(os.listdir(LICENCES))
            if os.path.isfile(os.path.join(LICENCES, name))}


def _stdlib_sources():
    return sorted(glob.glob(os.path.join(STDLIB, "*.py")))


def _numbers(rng):
    kinds = [
        lambda: ", ".join(str(rng.randint(0, 10 ** rng.randint(1, 9))) for _ in range(rng.randint(5, 60))),
        lambda: " ".join(f"{rng.uniform(-1000, 1000):.{rng.randint(0, 6)}f}" for _ in range(rng.randint(5, 40))),
        lambda: "\n".join(f"{a} + {b} = {a + b}" for a, b in
                          ((rng.randint(0, 9999), rng.randint(0, 9999)) for _ in range(rng.randint(3, 25)))),
        lambda: " ".join(f"0x{rng.getrandbits(32):08x}" for _ in range(rng.randint(4, 32))),
        lambda: "\n".join(f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T"
                          f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z  "
                          f"{rng.choice(['INFO', 'WARN', 'ERROR', 'DEBUG'])}  "
                          f"req={rng.getrandbits(24):06x} latency={rng.randint(1, 5000)}ms"
                          for _ in range(rng.randint(3, 20))),
        lambda: "| " + " | ".join(["id", "name", "qty", "price"]) + " |\n|---|---|---|---|\n" + "\n".join(
            f"| {i} | item{rng.randint(0, 999)} | {rng.randint(1, 50)} | ${rng.uniform(0.5, 99):.2f} |"
            for i in range(rng.randint(2, 15))),
        lambda: "".join(rng.choice("∀∃∈∉⊂⊆∪∩∑∏√∞≈≠≤≥±×÷→←↔⇒⇔∂∇αβγδεζηθλμπσφψω") + rng.choice(" ,;()[]{}")
                        for _ in range(rng.randint(10, 120))),
        lambda: " ".join(rng.choice(["https://example.org/", "ftp://mirror.test/", "mailto:someone@"]) +
                         "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789-_/?=&.%") for _ in
                                 range(rng.randint(5, 40))) for _ in range(rng.randint(1, 8))),
        lambda: "".join(chr(rng.randint(33, 126)) for _ in range(rng.randint(10, 300))),
        lambda: "π ≈ 3.14159265358979, e ≈ 2.71828182845904, φ ≈ 1.61803398874989; " * rng.randint(1, 6),
    ]
    return [rng.choice(kinds)() for _ in range(40)]


def build(seed=0):
    rng = random.Random(seed)
    prompts = []

    def add(kind, text=None, messages=None):
        entry = {"id": len(prompts), "kind": kind}
        if messages is not None:
            entry["messages"] = messages
        else:
            entry["text"] = text
        prompts.append(entry)

    licences = _licence_texts()
    paragraphs = [p for text in licences.values() for p in _paragraphs(text)]
    # prose: single paragraphs, and runs of paragraphs for the long prompts
    for p in rng.sample(paragraphs, 45):
        add("prose", p)
    for name, chars in (("GPL-3", 7000), ("Apache-2.0", 9000), ("MPL-2.0", 8000), ("GFDL-1.3", 6500),
                        ("LGPL-2.1", 10000), ("Artistic", 5000), ("CC0-1.0", 3000), ("GPL-2", 2600)):
        text = licences[name]
        start = rng.randint(0, max(0, len(text) - chars))
        add("prose-long", text[start:start + chars])
    # code: slices of standard-library modules, some long
    sources = _stdlib_sources()
    for path in rng.sample(sources, 40):
        lines = _read(path).splitlines()
        n = rng.choice([4, 8, 15, 30, 60])
        start = rng.randint(0, max(0, len(lines) - n))
        add("code", "\n".join(lines[start:start + n]))
    for path in rng.sample(sources, 6):
        text = _read(path)
        start = rng.randint(0, max(0, len(text) - 8000))
        add("code-long", text[start:start + rng.choice([5000, 6500, 8000])])
    headers = sorted(glob.glob("/usr/include/*.h"))
    for path in rng.sample(headers, min(12, len(headers))):
        lines = _read(path).splitlines()
        start = rng.randint(0, max(0, len(lines) - 25))
        add("code-c", "\n".join(lines[start:start + 25]))
    # multilingual text, alone and in pairs
    for text in MULTILINGUAL:
        add("multilingual", text)
    for _ in range(8):
        add("multilingual", " ".join(rng.sample(MULTILINGUAL, 3)))
    # numbers and symbols
    for text in _numbers(rng):
        add("numbers", text)
    # chat conversations, rendered with each model's own template by the recorder
    for messages in CHATS:
        add("chat", messages=messages)
    # very short prompts
    for text in ("Hello", "The", "1 2 3", "def", "Once upon a time", "<html>", "Q:", "Yes or no?", "#", "こんにちは"):
        add("short", text)
    return prompts


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prompts = build(args.seed)
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        json.dump({"seed": args.seed, "prompts": prompts}, f, ensure_ascii=False)
    kinds = {}
    for p in prompts:
        kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
    print(f"{len(prompts)} prompts: {kinds}")


if __name__ == "__main__":
    main()
