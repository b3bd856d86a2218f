"""The instruction-tuning example's data: short questions with one-word answers.

    python make_data.py           # writes chat.jsonl, pairs.jsonl, pairs_eval.jsonl here

chat.jsonl: conversations ({"messages": [...]}) for supervised fine-tuning
(configs/recipes/sft.py), a user question and the assistant's answer, some with a system
message. pairs.jsonl / pairs_eval.jsonl: preference pairs ({"prompt", "chosen",
"rejected"}) for configs/recipes/dpo.py, the answer in lower case chosen over the same
answer in capitals; the held-out pairs ask other questions, so a rising margin there
is the preference learned, not the pairs remembered.
"""

import json
import random

QA = [("colour of the sky?", "blue"), ("colour of grass?", "green"),
      ("capital of france?", "paris"), ("two plus two?", "four"),
      ("opposite of hot?", "cold"), ("animal that barks?", "dog"),
      ("planet we live on?", "earth"), ("frozen water?", "ice")]
HELD_OUT = [("colour of snow?", "white"), ("opposite of up?", "down"),
            ("animal that meows?", "cat"), ("one plus one?", "two")]


def write(name, rows):
    with open(name, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def main(seed=0):
    rng = random.Random(seed)
    chats = []
    for _ in range(96):
        q, a = rng.choice(QA)
        system = [{"role": "system", "content": "be brief."}] if rng.random() < 0.3 else []
        chats.append({"messages": system + [{"role": "user", "content": q},
                                            {"role": "assistant", "content": a}]})
    write("chat.jsonl", chats)
    write("pairs.jsonl", [{"prompt": q, "chosen": a, "rejected": a.upper()} for q, a in QA])
    write("pairs_eval.jsonl", [{"prompt": q, "chosen": a, "rejected": a.upper()}
                               for q, a in HELD_OUT])


if __name__ == "__main__":
    main()
