"""Tokenizers: load a Hugging Face tokenizer folder, or train a small byte-level BPE one.

Everything here goes through the ``tokenizer.json`` fast-tokenizer format, so a folder written by
``train_byte_level_bpe`` loads with ``transformers.AutoTokenizer.from_pretrained`` and any HF
model's tokenizer folder works with the preprocessing tool.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from mpformer.core.errors import ConfigError

if TYPE_CHECKING:  # transformers is imported lazily: it is slow to import and most callers never need it
    from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"


def load_tokenizer(tokenizer_dir: str | os.PathLike) -> PreTrainedTokenizerFast:
    """A ``transformers.PreTrainedTokenizerFast`` from a folder holding ``tokenizer.json``."""
    from transformers import PreTrainedTokenizerFast

    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise ConfigError(f"tokenizer folder {path} does not exist; pass a Hugging Face tokenizer directory")
    if not (path / "tokenizer.json").is_file():
        found = sorted(p.name for p in path.iterdir())[:8]
        raise ConfigError(
            f"tokenizer folder {path} has no tokenizer.json (found: {', '.join(found) or 'nothing'}); "
            f"only fast (tokenizer.json) tokenizers are supported"
        )
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # any loader failure means a bad folder, from the user's point of view
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"cannot load tokenizer from {path}: {type(e).__name__}: {first}") from e


def eos_id(tok: PreTrainedTokenizerFast) -> int:
    """The end-of-sequence token id; ConfigError when the tokenizer defines none."""
    eid = getattr(tok, "eos_token_id", None)
    if eid is None:
        name = getattr(tok, "name_or_path", "") or type(tok).__name__
        raise ConfigError(
            f"tokenizer {name} has no EOS token; set eos_token in its tokenizer_config.json "
            f"or preprocess with --no-append-eos"
        )
    return int(eid)


def _iter_texts(source: Iterable[str] | Iterable[os.PathLike]) -> tuple[list[str], Iterator[str] | None]:
    """Split the two accepted sources: (file paths, None) or ([], text iterator)."""
    items = iter(source)
    first = next(items, None)
    if first is None:
        raise ConfigError("train_byte_level_bpe got no training texts or files")
    if isinstance(first, os.PathLike):
        files = [os.fspath(first)]
        for item in items:
            if not isinstance(item, os.PathLike):
                raise ConfigError("train_byte_level_bpe: mix of paths and texts; pass only Path objects or only str")
            files.append(os.fspath(item))
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ConfigError(f"tokenizer training file {missing[0]} does not exist")
        return files, None

    def texts() -> Iterator[str]:
        yield first
        for t in items:
            if not isinstance(t, str):
                raise ConfigError(f"train_byte_level_bpe: expected str texts, got {type(t).__name__}")
            yield t

    if not isinstance(first, str):
        raise ConfigError(f"train_byte_level_bpe: expected str texts or Path files, got {type(first).__name__}")
    return [], texts()


def train_byte_level_bpe(
    source: Iterable[str] | Iterable[os.PathLike],
    out_dir: str | os.PathLike,
    vocab_size: int = 8192,
) -> Path:
    """Train a GPT-2 style byte-level BPE tokenizer and save it as a HF tokenizer folder.

    ``source`` is an iterable of texts (``str``) or of files (``pathlib.Path``: plain text, read
    line by line). A plain ``str`` is always text, never a path, so a path can't be mistaken for
    a one-line corpus. ``<|endoftext|>`` (id 0) is the only special token, used as EOS and BOS.
    All 256 byte symbols are in the vocabulary, so any text round-trips through encode/decode.
    Returns the folder.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise ConfigError(f"vocab_size must be >= 257 (256 bytes + {ENDOFTEXT}), got {vocab_size}")
    files, texts = _iter_texts(source)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if texts is not None:
        tok.train_from_iterator(texts, trainer=trainer)
    else:
        tok.train(files, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=ENDOFTEXT,
        bos_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,  # keep decode(encode(x)) == x
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


# Files of a Hugging Face tokenizer folder (what checkpoints and HF exports carry, nothing else).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files present in ``src`` into ``dst`` (created); returns their names."""
    found = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if found:
        dst.mkdir(parents=True, exist_ok=True)
        for f in found:
            shutil.copy2(src / f, dst / f)
    return found
