"""How well the default tiny model's tokenizer serves clients that see text, not ids.

Benchmarks and eval harnesses count tokens by tokenizing the text they receive, chunk by chunk
or whole, and compare texts. A token that decodes alone to U+FFFD (half a multi-byte character)
breaks both. For pagoda.gpu_worker.testing.tiny_model's tokenizer this reports: the ordinary tokens that decode
alone to valid text, exact encode/decode round trips over varied text (non-ASCII included), and
what a client that re-tokenizes each token's text counts, per real token.

    python bench/tokenizer_quality.py            # the tokenizer of the checkout on PYTHONPATH
"""
from __future__ import annotations

import argparse

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, the router sent a request to the worker that held its prefix.",
    "def main():\n    for i in range(10):\n        print(i * i)\n",
    "Les élèves étudient à l'école. Über den Wolken – “quoted” … €5",
    "Привет, как дела? Γειά σου κόσμε. ¡Hola, señor!",
    "東京は日本の首都です。北京是中国的首都。🙂🚀✨",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\"}}\r\n\t  end  ",
    "  leading spaces and\ttabs, User: What is 2+2?",
]


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    from pagoda.gpu_worker.testing.tiny_model import build_tokenizer
    tok = build_tokenizer(add_bos=False)
    added = set(tok.get_added_tokens_decoder())
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    ordinary = [i for i in range(tok.get_vocab_size()) if i not in specials]
    clean = [i for i in ordinary if "\ufffd" not in tok.decode([i], skip_special_tokens=False)]
    print(f"vocabulary {tok.get_vocab_size()} ({len(ordinary)} ordinary, {len(added - specials)} added)")
    print(f"ordinary tokens that decode alone to valid text: {len(clean)}/{len(ordinary)} "
          f"({100 * len(clean) / len(ordinary):.1f}%)")
    exact = pieces_exact = 0
    ids_total = chars = recount = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        exact += tok.decode(ids) == text
        pieces = [tok.decode([i]) for i in ids]
        pieces_exact += "".join(pieces) == text
        ids_total += len(ids)
        chars += len(text)
        recount += sum(len(tok.encode(p, add_special_tokens=False).ids) for p in pieces)
    print(f"round trip exact: {exact}/{len(TEXTS)} texts; token-by-token pieces concatenate to the text: "
          f"{pieces_exact}/{len(TEXTS)}")
    print(f"characters per token {chars / ids_total:.2f}; a client re-tokenizing each token's text counts "
          f"{recount / ids_total:.2f} tokens per real token")


if __name__ == "__main__":
    main()
