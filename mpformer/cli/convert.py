"""mpformer-convert: Hugging Face <-> mpformer checkpoints.

    mpformer-convert hf-to-mpformer --hf DIR --out DIR
    mpformer-convert mpformer-to-hf --ckpt DIR --out DIR [--tokenizer DIR]

``--ckpt`` takes a checkpoint step directory or a save directory with a ``latest`` pointer. The
HF output loads with ``transformers.AutoModelForCausalLM.from_pretrained(out)``. Stored dtypes are
kept both ways. User mistakes exit with status 2 and one ``error:`` line.
"""

from __future__ import annotations

import sys

from mpformer.core.errors import ArgumentParser, ConfigError, user_errors_to_exit


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="mpformer-convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="{hf-to-mpformer,mpformer-to-hf}")
    a = sub.add_parser("hf-to-mpformer", help="HF folder (config.json + safetensors) -> mpformer checkpoint")
    a.add_argument("--hf", required=True, metavar="DIR", help="HF model folder")
    a.add_argument("--out", required=True, metavar="DIR", help="new checkpoint directory (absent or empty)")
    b = sub.add_parser("mpformer-to-hf", help="mpformer checkpoint -> HF folder")
    b.add_argument("--ckpt", required=True, metavar="DIR", help="checkpoint step dir, or save dir with 'latest'")
    b.add_argument("--out", required=True, metavar="DIR", help="new HF folder (absent or empty)")
    b.add_argument("--tokenizer", metavar="DIR",
                   help="tokenizer folder to copy (default: the checkpoint's tokenizer/ if it has one)")
    b.add_argument("--max-shard-size-gb", type=float, default=5.0, metavar="GB",
                   help="split safetensors into shards of at most this size (default 5)")
    return p


@user_errors_to_exit
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mpformer.convert.io import hf_to_mpformer, mpformer_to_hf  # late: --help stays fast

    if args.command == "hf-to-mpformer":
        s = hf_to_mpformer(args.hf, args.out)
        what = "mpformer checkpoint"
    else:
        if not args.max_shard_size_gb > 0:
            raise ConfigError(f"--max-shard-size-gb={args.max_shard_size_gb} must be > 0 (GiB per safetensors shard)")
        s = mpformer_to_hf(args.ckpt, args.out, tokenizer=args.tokenizer,
                           max_shard_bytes=int(args.max_shard_size_gb * 2**30))
        what = "HF model"
    for note in s.notes:
        print(f"note: {note}", file=sys.stderr)
    tok = f", tokenizer ({len(s.tokenizer_files)} files)" if s.tokenizer_files else ""
    print(f"wrote {what} {s.out}: arch={s.arch}, {s.num_tensors} tensors, {s.num_params:,} parameters, "
          f"dtype={s.dtype}{tok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
