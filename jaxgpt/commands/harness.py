"""lm-evaluation-harness with jaxgpt's model registered: the harness's own command line, `--model jaxgpt` implied.

    jaxgpt harness --model_args workdir=runs/mine --tasks hellaswag,lambada_openai --batch_size 16
    jaxgpt harness --model_args init_from=hf:openai-community/gpt2,dtype=bfloat16 --tasks arc_easy

Every argument goes to the harness unchanged (`lm_eval --help` lists them); model arguments are those of
`jaxgpt.evals.harness.JaxGPTLM`: one of workdir=, init_from=, preset=, and which=, dtype=, max_gen_toks=,
bpe_file=. The harness (0.4.13) reads models only from its own registry, so `lm_eval --model jaxgpt` works
only in a process that imported `jaxgpt.evals.harness` first: this command is that process.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jaxgpt.errors import UserError, optional_import


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv[1:2]):
        print(__doc__)
        return 0
    try:
        optional_import("lm_eval", "jaxgpt harness (EleutherAI's lm-evaluation-harness)")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    import jaxgpt.evals.harness  # noqa: F401  (registers the "jaxgpt" model)

    model_given = any(a == "--model" or a.startswith("--model=") for a in argv[1:])
    sys.argv = ["lm_eval", "run", *([] if model_given else ["--model", "jaxgpt"]), *argv[1:]]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
