"""``mpformer-preprocess`` / ``tools/preprocess_data.py``: text files -> ``P.bin`` + ``P.idx``.

mpformer-preprocess --input a.jsonl --input b.txt --tokenizer TOKENIZER_DIR --output-prefix data/corpus
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from mpformer.core.errors import ArgumentParser, ConfigError, user_errors_to_exit


def build_parser() -> ArgumentParser:
    from mpformer.data.preprocess import TXT_SPLITS, default_workers

    p = ArgumentParser(
        prog="mpformer-preprocess",
        description="Tokenize .txt/.jsonl files into a Megatron-compatible indexed dataset (P.bin, P.idx).",
    )
    p.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="FILE",
        help="a .txt or .jsonl file; repeat for several, they are written in the given order",
    )
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="Hugging Face tokenizer folder (tokenizer.json)")
    p.add_argument("--output-prefix", required=True, metavar="P", help="writes P.bin and P.idx")
    p.add_argument("--json-key", default="text", help="field of each .jsonl record holding the text (default: text)")
    p.add_argument(
        "--txt-split",
        choices=TXT_SPLITS,
        default="document",
        help="what one document of a .txt file is (default: the whole file)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="tokenizer processes (default: min(4, cpu count)); the output does not depend on it",
    )
    p.add_argument(
        "--no-append-eos",
        dest="append_eos",
        action="store_false",
        help="do not append the tokenizer's EOS token after each document",
    )
    p.add_argument("--progress", action="store_true", help="show the datasets library's progress bars")
    return p


@user_errors_to_exit
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = str(args.output_prefix)
    if out.endswith(("/", os.sep)) or Path(out).is_dir():
        raise ConfigError(f"--output-prefix={out} is a directory; give a path prefix P (writes P.bin and P.idx)")
    import datasets

    from mpformer.data.preprocess import preprocess

    was_enabled = datasets.is_progress_bar_enabled()
    if not args.progress:
        datasets.disable_progress_bars()  # the one-line summary below is the default output
    try:
        result = preprocess(
            args.input,
            args.tokenizer,
            args.output_prefix,
            json_key=args.json_key,
            txt_split=args.txt_split,
            workers=args.workers,
            append_eos=args.append_eos,
        )
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
    print(result.summary(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
