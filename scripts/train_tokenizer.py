"""Train the bundled model's byte-level BPE tokenizer on the public-domain corpus.

The bundled model needs a vocabulary of its own: a borrowed one (GPT-2's 50k, Qwen's
151k) would spend most of a tiny model's parameters on an embedding table full of
tokens that never occur in Austen or Shakespeare. A byte-level BPE of 8192 tokens
covers every possible input (unknown bytes fall back to the 256 byte tokens) and
gives about four characters per token on this text.

Writes ``tokenizer.json`` and ``tokenizer_config.json`` so that
``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads it.

    python scripts/train_tokenizer.py --corpus ../shared/corpus --out .out/bundled
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS_FILES = ("austen.txt", "shakespeare.txt")
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen uses it: every turn is "<|im_start|>role\ncontent<|im_end|>\n".
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def train(corpus: Path, vocab_size: int, min_frequency: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus / name) for name in CORPUS_FILES], trainer)
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=Path("../shared/corpus"), help="folder with austen.txt and shakespeare.txt")
    p.add_argument("--out", type=Path, default=Path(".out/bundled"), help="folder to write the tokenizer files into")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--model-max-length", type=int, default=2048, help="the model's max_position_embeddings")
    args = p.parse_args()

    tok = train(args.corpus, args.vocab_size, args.min_frequency)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(args.model_max_length), indent=2) + "\n")

    text = "".join((args.corpus / name).read_text(encoding="utf-8") for name in CORPUS_FILES)
    n_tokens = len(tok.encode(text).ids)
    print(f"vocab {tok.get_vocab_size()}  corpus {len(text):,} chars -> {n_tokens:,} tokens "
          f"({len(text) / n_tokens:.2f} chars/token)  wrote {args.out}")


if __name__ == "__main__":
    main()
