"""Sample text from a trained language model: ``python -m ray_jobs.generate RUN_DIR --prompt TEXT``.

Runs in this process, no Ray: the run's model (``model.pt``, or ``best_model.pt`` with
``--checkpoint best``) and its ``tokenizer.json``, then one token at a time from the last position's
logits. Prints the prompt and the generated text to stdout (the end-of-text token shows as
``<|endoftext|>``), and how long it took to stderr. The same seed, model and prompt give the same text.
"""

from __future__ import annotations

import sys
import time

import torch

from ray_jobs.core.config import ArgumentParser, parse_model_options
from ray_jobs.predict.generate import Sampling, generate, load_language_model
from ray_jobs.predict.trained import WEIGHTS

# Sampling is one small forward per token: threads mostly wait on each other. On this repository's
# busy 2-core machine, 40 tokens of a 6-layer, 384-wide gpt took 2.1 s on 1 thread, 12 to 21 s on 2.
CPU_THREADS = 1


def parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m ray_jobs.generate", description=__doc__)
    parser.add_argument("path", metavar="RUN_DIR|model.pt", help="a finished lm run's directory, or a weights file")
    parser.add_argument("--prompt", default="", help="text to continue (default: empty, a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=Sampling.max_new_tokens, help="default: %(default)s")
    parser.add_argument(
        "--temperature", type=float, default=Sampling.temperature, help="0: greedy argmax (default: %(default)s)"
    )
    parser.add_argument("--top-k", type=int, default=None, help="draw among the k likeliest tokens (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the draws (default: %(default)s)")
    parser.add_argument(
        "--tokenizer", default=None, help="a tokenizer.json or its directory (default: the run's, or the file's beside)"
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default: %(default)s")
    parser.add_argument("--threads", type=int, default=CPU_THREADS, help="torch's CPU threads (default: %(default)s)")
    parser.add_argument(
        "--checkpoint", default="final", choices=tuple(WEIGHTS), help="final: model.pt; best: best_model.pt"
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="context tokens (default: the run's data's T, else the model's)"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a bare weights file's model (registered name or module.path:callable); for a run: its own "
        "module.path:callable, which runs only when named here",
    )
    parser.add_argument(
        "--model-option", action="append", default=[], metavar="KEY=VALUE", help="a bare weights file's model options"
    )
    parser.add_argument("--trust-model-code", action="store_true", help="run whatever model code the run names")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
        sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.seed)
        lm = load_language_model(
            args.path,
            checkpoint=args.checkpoint,
            model=args.model,
            model_options=parse_model_options(args.model_option),
            trust_model_code=args.trust_model_code,
            tokenizer=args.tokenizer,
            block_size=args.block_size,
            device=args.device,
        )
        start = time.monotonic()
        text = generate(lm, args.prompt, sampling)
    except (ValueError, OSError) as error:
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        print(f"error: {first}", file=sys.stderr)
        return 2
    print(text)
    seconds, count = time.monotonic() - start, sampling.max_new_tokens
    print(
        f"[raypar] {count} tokens in {seconds:.1f} s ({count / max(seconds, 1e-9):.0f}/s), "
        f"{lm.tokenizer.kind} tokenizer, context {lm.block_size}, seed {sampling.seed}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
