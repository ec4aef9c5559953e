"""Regenerate the tiny offline training assets: a text corpus and a byte-level BPE tokenizer.

    .venv/bin/python assets/build_assets.py

Everything is written from a seeded generator, so the output is the same on every machine:
  assets/tiny_text/train.jsonl   one {"text": ...} document per line (our own generated prose)
  assets/tokenizer/tokenizer.json, tokenizer_config.json   2000-token BPE, <= llama3 debugmodel's 2048
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VOCAB_SIZE = 2000
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

_NAMES = "Ada Bram Cora Dell Edda Finn Greta Hal Ines Jory Kit Lena Milo Nora Otto Pia Quill Rosa Sten Tova".split()
_PLACES = (
    "the mill, the harbour, the old bridge, the orchard, the lighthouse, the market, the north road, "
    "the quarry, the river bend, the school house, the bell tower, the salt marsh"
).split(", ")
_NOUNS = (
    "lantern kettle ledger compass basket ladder anchor violin map letter clock garden boat wheel "
    "candle bucket window barrel rope hammer loaf cart kite drum needle shovel sail mirror"
).split()
_ADJS = "quiet bright heavy narrow crooked patient gentle stubborn early late cold warm small broad".split()
_VERBS = (
    "carried mended painted counted found lost borrowed returned polished opened closed measured "
    "watched followed built sold"
).split()
_WEATHER = ["rain came in from the sea", "the wind turned to the east", "fog sat low on the fields",
            "the sun stayed out past supper", "snow fell without a sound", "the tide ran high"]
_NUMBERS = "one two three four five six seven eight nine ten twelve twenty".split()


def _sentence(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    noun, noun2 = rng.sample(_NOUNS, 2)
    adj, verb, place = rng.choice(_ADJS), rng.choice(_VERBS), rng.choice(_PLACES)
    forms = [
        f"{a} {verb} the {adj} {noun} at {place}.",
        f"In the morning {a} and {b} walked to {place} with a {noun}.",
        f"When the {rng.choice(_WEATHER)}, {a} {verb} the {noun2} and waited for {b}.",
        f"There were {rng.choice(_NUMBERS)} {noun}s by the door, and {b} {verb} every one of them.",
        f"{b} said that the {noun} at {place} was {adj}, but {a} did not agree.",
        f"Nobody at {place} remembered who had {verb} the {adj} {noun2} first.",
        f"By evening the {noun} was {adj} again, and {a} wrote it down in the ledger.",
    ]
    return rng.choice(forms)


def build_text(n_docs: int = 600, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        paragraphs = [" ".join(_sentence(rng) for _ in range(rng.randint(3, 7))) for _ in range(rng.randint(1, 3))]
        docs.append("\n\n".join(paragraphs))
    return docs


def build_tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def main() -> None:
    docs = build_text()
    data_dir = ROOT / "tiny_text"
    data_dir.mkdir(exist_ok=True)
    with open(data_dir / "train.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")

    tok = build_tokenizer(docs)
    tok_dir = ROOT / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True,
              "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    n_tokens = sum(len(tok.encode(d).ids) for d in docs)
    print(f"{len(docs)} documents, {n_tokens} tokens, vocab {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
