"""Regenerate every file in ``data_samples/`` deterministically.

Usage (from the repository root)::

    .venv/bin/python data_samples/make_samples.py

Outputs (all next to this script):

* ``flan_like.jsonl``  ~4000 instruction records built from docstrings of the
  Python standard library (parsed with ``ast``; nothing is imported), with a
  long-tailed token-length distribution.
* ``orca_like.jsonl``  ~2000 templated math word problems with step-by-step
  solutions (seeded RNG), homogeneous token lengths.
* ``long_docs.jsonl``  a handful of whole stdlib source files (20K-200K tokens)
  for sequence-parallel / long-context work.
* ``chat_like.jsonl``  200 conversations ``{"messages": [{"role", "content"}...]}``
  made of flan_like and orca_like records (one to three user/assistant
  exchanges, sometimes a system turn first).
* ``tokenizer/``       byte-level BPE (vocab 8192) trained on the text above
  (all ~7.8K candidate docstring records, of which flan_like is a subset, plus
  orca_like and long_docs), loadable with
  ``transformers.PreTrainedTokenizerFast.from_pretrained``; its chat template
  marks the assistant turns with ``{% generation %}`` (assistant token masks).
* ``configs/<family>/config.json``  tiny random-init llama / mistral / qwen2
  configs.

Determinism: fixed seeds, sorted directory walks, no timestamps, single-threaded
tokenizer training.  The text comes from the stdlib of the running interpreter,
so a different Python version produces different (but still deterministic)
files.  Dependencies: the standard library plus ``tokenizers``.
"""

import ast
import copy
import json
import os
import random
import statistics
import sys
import sysconfig
from fractions import Fraction
from pathlib import Path

# Must be set before ``tokenizers`` starts its thread pool.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

OUT = Path(__file__).resolve().parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SEED = 1234
VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3
N_FLAN, N_ORCA, N_CHAT = 4000, 2000, 200
MIN_TOKENS, MAX_TOKENS = 8, 2048
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib-dynload",
             "pydoc_data", "turtledemo", "ensurepip", "lib2to3"}
# Whole stdlib files (or one package's files concatenated) for long_docs.jsonl,
# chosen so the token counts span roughly 20K .. 200K.
LONG_DOCS = [["difflib.py"], ["_pydecimal.py"], ["email"], ["asyncio"], ["idlelib"]]


# --------------------------------------------------------------------------- io
def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=False) + "\n")


def write_json(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def stdlib_files():
    """Yield (relative posix path, text) for stdlib .py files, sorted."""
    for root, dirs, files in os.walk(STDLIB):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(files):
            if name.endswith(".py") and not name.startswith("test_"):
                path = Path(root, name)
                yield path.relative_to(STDLIB).as_posix(), path.read_text(encoding="utf-8")


# ---------------------------------------------------------------- flan-like data
FUNC_TEMPLATES = [
    "Explain what `{qual}` does.",
    "In the Python standard library, what is the purpose of `{qual}`?",
    "I'm reading the `{mod}` module. Can you describe `{name}{sig}`?",
    "Write a docstring for the function `{name}` in module `{mod}`, whose signature is `{name}{sig}`.",
    "Document the following Python function from `{mod}`:\n\n```python\n{source}\n```",
    "What does the following code do?\n\n```python\n{source}\n```",
]
RETURN_TEMPLATES = ["What does `{call}` return?", "What is the result of calling `{call}` (from `{mod}`)?"]
METHOD_TEMPLATES = [
    "Explain the method `{cls}.{name}` of module `{mod}`.",
    "What does calling `obj.{name}{sig}` do, where `obj` is an instance of `{mod}.{cls}`?",
    "Describe `{qual}`.",
    "Write the docstring for this method of class `{cls}`:\n\n```python\n{source}\n```",
]
CLASS_TEMPLATES = [
    "Summarise the purpose of class `{name}` in module `{mod}`.",
    "What is `{mod}.{name}` used for?",
    "Describe the class `{name}` (bases: {bases}) from `{mod}`.",
    "Explain, as its docstring would, what the `{qual}` class represents.",
    "Write the class docstring for this class from `{mod}`:\n\n```python\n{source}\n```",
]
MODULE_TEMPLATES = [
    "Give an overview of the `{mod}` module.",
    "What is the Python module `{mod}` for?",
    "Write the module docstring for `{mod}`.",
]
MAX_SOURCE_CHARS = 8000  # larger definitions fall back to a template without source


def module_name(rel):
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def short_source(node):
    """Source of a definition without its own docstring; None if it is too long for a prompt."""
    node = copy.deepcopy(node)
    node.body = node.body[1:] or [ast.Expr(ast.Constant(...))]
    source = ast.unparse(node)
    return source if len(source) <= MAX_SOURCE_CHARS else None


def docstring_items(rel, text):
    """Yield dicts describing every documented module/class/function/method."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    mod = module_name(rel)
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        yield {"kind": "module", "mod": mod, "qual": mod, "doc": doc}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from function_item(node, mod, None)
        elif isinstance(node, ast.ClassDef):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                bases = ", ".join(ast.unparse(b) for b in node.bases) or "object"
                yield {"kind": "class", "mod": mod, "name": node.name, "qual": f"{mod}.{node.name}",
                       "bases": bases, "doc": doc, "source": short_source(node)}
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield from function_item(sub, mod, node.name)


def function_item(node, mod, cls):
    doc = ast.get_docstring(node, clean=True)
    if not doc:
        return
    params = copy.deepcopy(node.args)  # shown without the self/cls parameter
    for group in (params.posonlyargs, params.args):
        if cls and group and group[0].arg in ("self", "cls"):
            del group[0]
            break
    args = [a.arg for a in params.posonlyargs + params.args]
    sig = "(" + ast.unparse(params) + ")"
    yield {"kind": "method" if cls else "function", "mod": mod, "cls": cls, "name": node.name,
           "qual": f"{mod}.{cls}.{node.name}" if cls else f"{mod}.{node.name}",
           "sig": sig, "call": f"{node.name}({', '.join(args)})", "doc": doc,
           "source": short_source(node)}


def make_prompt(item, rng):
    kind = item["kind"]
    if kind == "module":
        templates = MODULE_TEMPLATES
    elif kind == "class":
        templates = CLASS_TEMPLATES
    else:
        templates = METHOD_TEMPLATES if kind == "method" else FUNC_TEMPLATES
        if kind == "function" and item["doc"].lower().startswith("return"):
            templates = templates + RETURN_TEMPLATES * 2
    if item.get("source") is None:
        templates = [t for t in templates if "{source}" not in t]
    return rng.choice(templates).format(**item)


def flan_candidates():
    """One candidate record per distinct docstring in the stdlib."""
    rng = random.Random(SEED)
    seen, rows = set(), []
    for rel, text in stdlib_files():
        for item in docstring_items(rel, text):
            if item["doc"] in seen:
                continue
            seen.add(item["doc"])
            rows.append({"prompt": make_prompt(item, rng), "completion": item["doc"],
                         "source": f"python-stdlib:{item['qual']}"})
    return rows


def clip_completion(tok, row, budget):
    """Cut the completion at a token boundary so prompt+completion <= budget tokens.

    Returns None when the prompt alone leaves less than 64 tokens for the completion."""
    room = budget - len(tok.encode(row["prompt"]).ids)
    while room >= 64:
        enc = tok.encode(row["completion"])
        if len(enc.ids) <= room:
            return row
        row = dict(row, completion=row["completion"][: enc.offsets[room - 1][1]].rstrip())
        room -= 1
    return None


def select_flan(tok, candidates):
    """Length-biased seeded sample: keep the natural long tail, lift the median."""
    pool = []
    for row, n in zip(candidates, token_lengths(tok, candidates)):
        if n > MAX_TOKENS:
            row, n = clip_completion(tok, row, MAX_TOKENS), MAX_TOKENS
        if row is not None and n >= MIN_TOKENS:
            pool.append((row, n))
    # Efraimidis-Spirakis weighted sampling without replacement; short records are down-weighted.
    rng = random.Random(SEED + 1)
    keyed = sorted(pool, key=lambda rn: rng.random() ** (1.0 / min(1.0, (rn[1] / 150.0) ** 2)))
    chosen = sorted((row for row, _ in keyed[-N_FLAN:]), key=lambda r: r["source"])
    random.Random(SEED + 3).shuffle(chosen)  # mixed modules and templates from the first line on
    return chosen


# ---------------------------------------------------------------- orca-like data
# Each q_* function draws one problem and returns (prompt, facts, plan, steps, answer);
# every number in a solution is computed, never typed, so the arithmetic is exact.
NAMES = ["Aisha", "Ben", "Carlos", "Dana", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal",
         "Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq"]
ITEMS = [("notebook", 3), ("pen", 1), ("backpack", 24), ("calculator", 15), ("water bottle", 8),
         ("T-shirt", 12), ("book", 9), ("lamp", 21), ("mug", 6), ("scarf", 14), ("puzzle", 17)]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]


def money(cents):
    return f"${cents // 100:,}.{cents % 100:02d}"


def plural(n, word):
    return f"{n} {word}" + ("" if n == 1 else "s")


def q_shopping(rng):
    name = rng.choice(NAMES)
    picks = rng.sample(ITEMS, rng.randint(2, 7))
    facts, steps, costs = [], [], []
    for item, base in picks:
        qty, price = rng.randint(2, 9), base * 100 + rng.choice([0, 25, 50, 75, 99])
        costs.append(qty * price)
        facts.append(f"{qty} {item}s cost {money(price)} each.")
        steps.append(f"Cost of the {item}s: {qty} x {money(price)} = {money(qty * price)}.")
    total = sum(costs)
    paid = (total // 5000 + 1) * 5000
    facts.append(f"{name} pays with {money(paid)}.")
    steps.append("Add the costs together: " + " + ".join(map(money, costs)) + f" = {money(total)}.")
    steps.append(f"Change = amount paid - total cost = {money(paid)} - {money(total)} = {money(paid - total)}.")
    prompt = (f"{name} goes shopping and buys " + ", ".join(f[:-1].replace(" cost ", " at ") for f in facts[:-2])
              + f" and {facts[-2][:-1].replace(' cost ', ' at ')}. {name} pays with {money(paid)} in cash. "
              f"How much change should {name} receive?")
    plan = "First find the cost of each kind of item, then the total bill, then subtract it from the cash."
    return prompt, facts, plan, steps, money(paid - total)


def q_discount(rng):
    while True:
        price, qty = rng.randint(20, 300), rng.randint(2, 5)
        disc, tax = rng.choice([10, 15, 20, 25, 30, 40]), rng.choice([5, 6, 8, 10])
        sub = price * 100 * qty
        off, taxed = Fraction(sub * disc, 100), Fraction((sub - sub * disc // 100) * tax, 100)
        if off.denominator == 1 and taxed.denominator == 1:
            off, taxed = int(off), int(taxed)
            break
    name, item = rng.choice(NAMES), rng.choice(["jacket", "pair of boots", "helmet", "tent"])
    final = sub - off + taxed
    facts = [f"One {item} costs {money(price * 100)} before the sale.", f"The sale takes {disc}% off.",
             f"A sales tax of {tax}% is added after the discount.", f"{name} buys {qty}."]
    prompt = (f"A {item} normally costs {money(price * 100)}. During a sale the store takes {disc}% off, "
              f"and then a sales tax of {tax}% is added to the discounted price. {name} buys {qty} of them. "
              f"How much does {name} pay in total?")
    plan = "Apply the discount to the full price first, and only then add the tax on the reduced amount."
    steps = [f"Price before any discount: {qty} x {money(price * 100)} = {money(sub)}.",
             f"Discount: {disc}% of {money(sub)} = {money(sub)} x {disc} / 100 = {money(off)}.",
             f"Discounted price: {money(sub)} - {money(off)} = {money(sub - off)}.",
             f"Tax: {tax}% of {money(sub - off)} = {money(taxed)}.",
             f"Total paid: {money(sub - off)} + {money(taxed)} = {money(final)}."]
    return prompt, facts, plan, steps, money(final)


def q_travel(rng):
    name = rng.choice(NAMES)
    legs = [(rng.choice([40, 45, 50, 60, 64, 70, 80, 90]), rng.randint(1, 4)) for _ in range(rng.randint(2, 7))]
    dist = [s * h for s, h in legs]
    total = sum(dist)
    trip = total + rng.randint(20, 200)
    facts = [f"The city is {trip} km away."] + [f"Leg {i}: {s} km/h for {plural(h, 'hour')}."
                                                 for i, (s, h) in enumerate(legs, 1)]
    prompt = (f"{name} is driving to a city {trip} km away. {name} "
              + ", then ".join(f"drives at {s} km/h for {plural(h, 'hour')}" for s, h in legs)
              + f". How many kilometres does {name} still have to drive?")
    plan = "Distance = speed x time for each leg; the remaining distance is the trip length minus their sum."
    steps = [f"Leg {i}: {s} km/h x {h} h = {d} km." for i, ((s, h), d) in enumerate(zip(legs, dist), 1)]
    steps.append("Distance driven so far: " + " + ".join(map(str, dist)) + f" = {total} km.")
    steps.append(f"Distance remaining: {trip} - {total} = {trip - total} km.")
    return prompt, facts, plan, steps, f"{trip - total} km"


def q_savings(rng):
    name = rng.choice(NAMES)
    start, weekly, price = rng.randint(10, 90), rng.randint(7, 35), rng.randint(150, 900)
    gift = rng.choice([0, 20, 25, 50])
    have = start + gift
    need = price - have
    weeks = -(-need // weekly)
    facts = [f"The bicycle costs ${price}.", f"{name} has ${start} saved."]
    facts += [f"A grandparent gives ${gift}."] if gift else []
    facts += [f"{name} saves ${weekly} per week."]
    prompt = (f"{name} wants to buy a bicycle that costs ${price}. {name} already has ${start} saved"
              + (f" and will get ${gift} from a grandparent" if gift else "")
              + f". If {name} saves ${weekly} every week, how many weeks will it take to afford the bicycle?")
    plan = "Find how much is still missing, divide by the weekly savings, and round up to whole weeks."
    steps = [f"Money available now: ${start}" + (f" + ${gift} = ${have}." if gift else "."),
             f"Amount still needed: ${price} - ${have} = ${need}.",
             f"Weeks needed: {need} / {weekly} = {need / weekly:.2f}.",
             f"Only whole weeks count, so round up to {weeks} weeks.",
             f"Check: ${have} + {weeks} x ${weekly} = ${have + weeks * weekly}, which covers ${price}, "
             f"while after {weeks - 1} weeks {name} would have only ${have + (weeks - 1) * weekly}."]
    return prompt, facts, plan, steps, plural(weeks, "week")


def q_ages(rng):
    while True:
        k1, k2, child = rng.randint(3, 6), rng.randint(2, 5), rng.randint(4, 16)
        if k2 < k1 and (child * (k1 - k2)) % (k2 - 1) == 0 and 1 <= child * (k1 - k2) // (k2 - 1) <= 30:
            n = child * (k1 - k2) // (k2 - 1)
            break
    a, b = rng.sample(NAMES, 2)
    parent = k1 * child
    facts = [f"Now, {a}'s age is {k1} times {b}'s age.", f"In {n} years, {a}'s age will be {k2} times {b}'s age."]
    prompt = (f"{a} is {k1} times as old as {b}. In {n} years, {a} will be {k2} times as old as {b}. "
              f"How old is {a} now?")
    plan = f"Write both ages in terms of {b}'s current age and turn the second fact into an equation."
    steps = [f"Let {b}'s age now be x, so {a}'s age now is {k1}x.",
             f"In {n} years: {b} is x + {n} and {a} is {k1}x + {n}.",
             f"Equation: {k1}x + {n} = {k2}(x + {n}) = {k2}x + {k2 * n}.",
             f"Subtract {k2}x and {n} from both sides: "
             f"{k1 - k2 if k1 - k2 > 1 else ''}x = {k2 * n - n}, so x = {child}.",
             f"{a}'s age now: {k1} x {child} = {parent}.",
             f"Check: in {n} years the ages are {parent + n} and "
             f"{child + n}, and {k2} x {child + n} = {k2 * (child + n)}."]
    return prompt, facts, plan, steps, f"{parent} years old"


def q_garden(rng):
    length, width = rng.randint(8, 40), rng.randint(5, 30)
    gate, price, seed = rng.choice([1, 2, 3]), rng.randint(4, 19), rng.choice([2, 3, 4, 5])
    per, area = 2 * (length + width), length * width
    facts = [f"The garden is {length} m by {width} m.", f"The gate is {gate} m wide and needs no fence.",
             f"Fencing costs ${price} per metre.", f"Seed is sown at {seed} g per square metre."]
    prompt = (f"A rectangular garden is {length} m long and {width} m wide. It will be fenced all the way "
              f"around except for a gate {gate} m wide, and fencing costs ${price} per metre. Grass seed is "
              f"needed at {seed} grams per square metre. What is the cost of the fence, and how many grams "
              f"of seed are needed?")
    plan = "The fence depends on the perimeter, the seed on the area; handle them separately."
    steps = [f"Perimeter: 2 x ({length} + {width}) = {per} m.",
             f"Fence length without the gate: {per} - {gate} = {per - gate} m.",
             f"Fence cost: {per - gate} x ${price} = ${(per - gate) * price}.",
             f"Area: {length} x {width} = {area} square metres.",
             f"Seed: {area} x {seed} = {area * seed} grams."]
    return prompt, facts, plan, steps, f"${(per - gate) * price} and {area * seed} grams"


def q_ratio(rng):
    people = rng.sample(NAMES, rng.randint(2, 7))
    ratio = [rng.randint(1, 9) for _ in people]
    part = rng.randint(5, 60)
    total, shares = part * sum(ratio), [r * part for r in ratio]
    facts = [f"The amount shared is ${total}.", "The ratio is " + ":".join(map(str, ratio))
             + " for " + ", ".join(people) + "."]
    prompt = (f"{', '.join(people[:-1])} and {people[-1]} share ${total} in the ratio {':'.join(map(str, ratio))}. "
              f"How much more does the person with the largest share get than the person with the smallest?")
    plan = "Count the parts, find the value of one part, then compute each share."
    steps = [f"Total parts: {' + '.join(map(str, ratio))} = {sum(ratio)}.",
             f"One part: ${total} / {sum(ratio)} = ${part}."]
    steps += [f"{p} gets {r} x ${part} = ${s}." for p, r, s in zip(people, ratio, shares)]
    steps.append(f"Largest minus smallest: ${max(shares)} - ${min(shares)} = ${max(shares) - min(shares)}.")
    return prompt, facts, plan, steps, f"${max(shares) - min(shares)}"


def q_wages(rng):
    name, rate = rng.choice(NAMES), rng.randint(12, 40)
    days = DAYS[: rng.randint(3, 6)]
    hours = [rng.randint(6, 12) for _ in days]
    total = sum(hours)
    over = max(0, total - 40)
    pay = rate * 100 * (total - over) + rate * 150 * over  # in cents
    facts = [f"The hourly rate is ${rate}; hours beyond 40 pay 1.5 times that."]
    facts += [f"{d}: {plural(h, 'hour')}." for h, d in zip(hours, days)]
    prompt = (f"{name} earns ${rate} per hour, and any hours beyond 40 in a week are paid at time and a half. "
              f"This week {name} worked " + ", ".join(f"{h} hours on {d}" for h, d in zip(hours, days))
              + f". How much did {name} earn this week?")
    plan = "Total the hours, split them into regular and overtime hours, and price each part."
    steps = ["Total hours: " + " + ".join(map(str, hours)) + f" = {total}."]
    if over:
        steps += [f"Regular hours: 40; overtime hours: {total} - 40 = {over}.",
                  f"Regular pay: 40 x ${rate} = ${40 * rate}.",
                  f"Overtime rate: 1.5 x ${rate} = {money(rate * 150)} per hour.",
                  f"Overtime pay: {over} x {money(rate * 150)} = {money(rate * 150 * over)}.",
                  f"Total pay: ${40 * rate} + {money(rate * 150 * over)} = {money(pay)}."]
    else:
        steps += [f"{total} hours is not more than 40, so there is no overtime.",
                  f"Total pay: {total} x ${rate} = {money(pay)}."]
    return prompt, facts, plan, steps, money(pay)


def q_average(rng):
    name = rng.choice(NAMES)
    while True:
        scores = [rng.randint(60, 95) for _ in range(rng.randint(3, 9))]
        n = len(scores) + 1
        target = -(-sum(scores) // len(scores)) + rng.randint(0, 4)
        need = target * n - sum(scores)
        if need <= 100:
            break
    facts = ["Scores so far: " + ", ".join(map(str, scores)) + ".", f"Target average: {target} over {n} tests."]
    prompt = (f"{name} scored " + ", ".join(map(str, scores[:-1])) + f" and {scores[-1]} on the first "
              f"{len(scores)} tests of the term. What score does {name} need on the next test to have an "
              f"average of exactly {target} over all {n} tests?")
    plan = "An average fixes the total, so compare the required total with the current one."
    steps = [f"Required total: {target} x {n} = {target * n}.",
             "Current total: " + " + ".join(map(str, scores)) + f" = {sum(scores)}.",
             f"Score needed: {target * n} - {sum(scores)} = {need}.",
             f"Check: ({sum(scores)} + {need}) / {n} = {(sum(scores) + need) // n}."]
    return prompt, facts, plan, steps, str(need)


def q_bakery(rng):
    while True:
        made, p1, p2 = rng.randint(6, 40) * 12, rng.choice([2, 3, 4, 5]), rng.choice([2, 3, 4])
        left1 = made - made // p1
        if made % p1 == 0 and left1 % p2 == 0:
            break
    given = rng.randint(0, left1 // 4)
    sold2 = left1 // p2
    left = left1 - sold2 - given
    facts = [f"{made // 12} dozen muffins were baked.", f"1/{p1} were sold in the morning.",
             f"1/{p2} of the rest were sold in the afternoon.", f"{given} were given to a food bank."]
    prompt = (f"A bakery baked {made // 12} dozen muffins. In the morning it sold 1/{p1} of them. In the "
              f"afternoon it sold 1/{p2} of the muffins that were left, and at closing time it gave {given} "
              f"muffins to a food bank. How many muffins remain?")
    plan = "Work through the day in order, keeping track of how many muffins are left after each event."
    steps = [f"Muffins baked: {made // 12} x 12 = {made}.",
             f"Morning: {made} / {p1} = {made // p1} sold, leaving {made} - {made // p1} = {left1}.",
             f"Afternoon: {left1} / {p2} = {sold2} sold, leaving {left1} - {sold2} = {left1 - sold2}.",
             f"Food bank: {left1 - sold2} - {given} = {left}."]
    return prompt, facts, plan, steps, f"{left} muffins"


def q_club(rng):
    while True:
        n, pg, pc = rng.randint(20, 60), rng.choice([25, 40, 50, 60, 75]), rng.choice([20, 25, 40, 50, 60, 75, 80])
        girls = n * pg // 100
        if (n * pg) % 100 == 0 and (girls * pc) % 100 == 0 and ((n - girls) * pc) % 100 == 0:
            break
    boys = n - girls
    cg, cb = girls * pc // 100, boys * pc // 100
    facts = [f"The club has {n} members.", f"{pg}% of the members are girls.",
             f"{pc}% of the girls and {pc}% of the boys signed up."]
    prompt = (f"A school club has {n} members and {pg}% of them are girls. {pc}% of the girls and {pc}% of the "
              f"boys signed up for a chess tournament. How many members did not sign up?")
    plan = "Split the club into girls and boys, count who signed up in each group, and subtract from the total."
    steps = [f"Girls: {pg}% of {n} = {girls}; boys: {n} - {girls} = {boys}.",
             f"Girls who signed up: {pc}% of {girls} = {cg}.",
             f"Boys who signed up: {pc}% of {boys} = {cb}.",
             f"Signed up in total: {cg} + {cb} = {cg + cb}.",
             f"Did not sign up: {n} - {cg + cb} = {n - cg - cb}."]
    return prompt, facts, plan, steps, str(n - cg - cb)


MATH_FAMILIES = [q_shopping, q_discount, q_travel, q_savings, q_ages, q_garden, q_ratio, q_wages,
                 q_average, q_bakery, q_club]
OPENERS = ["Let's solve this step by step.", "We work through the problem one step at a time.",
           "Let's break the problem into smaller steps.", "Here is a step-by-step solution."]


def orca_rows():
    rng = random.Random(SEED + 2)
    rows = []
    for i in range(N_ORCA):
        prompt, facts, plan, steps, answer = MATH_FAMILIES[i % len(MATH_FAMILIES)](rng)
        # Optional "known facts" and "plan" sections vary the verbosity, like real solutions.
        question = prompt[prompt.rindex(". ") + 2:]
        lines = [rng.choice(OPENERS), "", f"The question: {question}", "", "What we know:"]
        lines += [f"- {f}" for f in facts] + [""]
        if rng.random() < 0.5:
            lines += [f"Plan: {plan}", ""]
        lines += [f"Step {k}: {s}" for k, s in enumerate(steps, 1)] + ["", f"The answer is {answer}."]
        completion = "\n".join(lines)
        rows.append({"prompt": prompt, "completion": completion, "source": "synthetic-math"})
    return rows


# ------------------------------------------------------------------- long docs
def long_doc_rows():
    rows = []
    for members in LONG_DOCS:
        paths = []
        for m in members:
            if m.endswith(".py"):
                paths.append(m)
            else:  # a package: all of its .py files, sorted
                paths += sorted(p.relative_to(STDLIB).as_posix() for p in (STDLIB / m).rglob("*.py")
                                if not SKIP_DIRS.intersection(p.relative_to(STDLIB).parts))
        texts = [(STDLIB / p).read_text(encoding="utf-8") for p in paths]
        if len(paths) == 1:
            text = texts[0]
        else:
            text = "".join(f"# ===== {p} =====\n{t}" + ("" if t.endswith("\n") else "\n")
                           for p, t in zip(paths, texts))
        rows.append({"name": "+".join(paths), "text": text})
    return rows


# ------------------------------------------------------------------- chat
SYSTEM_TURNS = ["You are a concise assistant for Python and arithmetic questions.",
                "Answer as the Python documentation would.", "Explain your reasoning step by step."]
# Role headers as plain text, bos first, eos closing every assistant turn; {% generation %} marks the trained tokens
# (what `apply_chat_template(..., return_assistant_tokens_mask=True)` reads).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + eos_token }}{%- endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}")


def chat_rows(flan, orca):
    """Conversations from shipped records: each exchange is a record's prompt (user) and completion (assistant)."""
    rng = random.Random(SEED + 3)
    pool = flan + orca
    rows = []
    for _ in range(N_CHAT):
        messages = [{"role": "system", "content": rng.choice(SYSTEM_TURNS)}] if rng.random() < 0.3 else []
        for r in rng.sample(pool, rng.choice((1, 1, 2, 3))):
            messages += [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]
        rows.append({"messages": messages})
    return rows


# ------------------------------------------------------------------- tokenizer
def train_tokenizer(texts):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok, folder):
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"), pretty=True)
    special = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    write_json(folder / "special_tokens_map.json", special)
    write_json(folder / "tokenizer_config.json", dict(
        special, tokenizer_class="PreTrainedTokenizerFast", model_max_length=262144,
        clean_up_tokenization_spaces=False, padding_side="right", chat_template=CHAT_TEMPLATE))


def token_lengths(tok, rows, keys=("prompt", "completion")):
    out = [0] * len(rows)
    for key in keys:
        encs = tok.encode_batch([r[key] for r in rows])
        out = [n + len(e.ids) for n, e in zip(out, encs)]
    return out


# --------------------------------------------------------------------- configs
def model_configs(tok):
    ids = {"pad_token_id": tok.token_to_id("<pad>"), "bos_token_id": tok.token_to_id("<s>"),
           "eos_token_id": tok.token_to_id("</s>")}
    common = dict(ids, vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                  max_position_embeddings=262144, tie_word_embeddings=False)
    return {
        "llama": dict(common, model_type="llama", architectures=["LlamaForCausalLM"], num_key_value_heads=4),
        "mistral": dict(common, model_type="mistral", architectures=["MistralForCausalLM"],
                        num_key_value_heads=2, sliding_window=16),
        "qwen2": dict(common, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                      num_key_value_heads=2, use_sliding_window=False),
    }


# ------------------------------------------------------------------------ main
def describe(name, lengths):
    s = sorted(lengths)
    p95 = s[min(len(s) - 1, int(0.95 * len(s)))]
    cv = statistics.pstdev(s) / statistics.mean(s)
    return (f"| {name:<15} | {len(s):>5} | {s[0]:>6} | {statistics.median(s):>8.0f} | "
            f"{statistics.mean(s):>8.1f} | {p95:>6} | {s[-1]:>7} | {cv:>5.2f} |")


def main():
    candidates = flan_candidates()
    orca = orca_rows()
    docs = long_doc_rows()
    # The tokenizer sees every candidate docstring; the shipped flan sample is a subset of them.
    corpus = [t for r in candidates + orca for t in (r["prompt"], r["completion"])]
    corpus += [d["text"] for d in docs]
    tok = train_tokenizer(corpus)
    flan = select_flan(tok, candidates)

    write_jsonl(OUT / "flan_like.jsonl", flan)
    write_jsonl(OUT / "orca_like.jsonl", orca)
    write_jsonl(OUT / "long_docs.jsonl", docs)
    write_jsonl(OUT / "chat_like.jsonl", chat_rows(flan, orca))
    save_tokenizer(tok, OUT / "tokenizer")
    for family, cfg in model_configs(tok).items():
        write_json(OUT / "configs" / family / "config.json", cfg)

    for text in [flan[0]["completion"], orca[0]["completion"], docs[0]["text"][:5000]]:
        assert tok.decode(tok.encode(text).ids) == text, "tokenizer round-trip failed"
    flan_len, orca_len = token_lengths(tok, flan), token_lengths(tok, orca)
    doc_len = token_lengths(tok, docs, keys=("text",))
    assert MIN_TOKENS <= min(flan_len) and max(flan_len) <= MAX_TOKENS
    print(f"Python {sys.version.split()[0]}; tokens = prompt + completion (long_docs: text), "
          "no special tokens")
    print("| sample          | count |    min |   median |     mean |    p95 |     max |    cv |")
    print("|-----------------|-------|--------|----------|----------|--------|---------|-------|")
    print(describe("flan_like", flan_len))
    print(describe("orca_like", orca_len))
    print(describe("long_docs", doc_len))
    for d, n in zip(docs, doc_len):
        files = d["name"].split("+")
        label = files[0] if len(files) == 1 else f"{files[0].split('/')[0]}/ ({len(files)} files)"
        print(f"  long_docs: {n:>7} tokens  {len(d['text']):>8} chars  {label}")


if __name__ == "__main__":
    main()
