"""tinker-cookbook's ``rl_basic`` recipe, unchanged, against ``spinwheel tinker``.

The recipe's ``main`` and the cookbook's RL training loop (``tinker_cookbook.rl.train``: sampling groups through the
SDK's sampling client, group-centred advantages, ``importance_sampling`` loss, ``optim_step``, new sampler weights
every step) run as published; what differs from ``rl_basic.build_config_blueprint`` is only what the issue allows:

- the model: SmolLM2-135M-Instruct from its local directory (the cookbook loads the tokenizer with
  ``AutoTokenizer.from_pretrained(model_name)``); the renderer by name, ``qwen3_instruct`` (ChatML, as SmolLM2's chat
  template; the cookbook's ``model_info`` knows no SmolLM2);
- the dataset: the cookbook's own offline ``ArithmeticDatasetBuilder`` ("What is x + y?", x, y in 0..100, one
  few-shot example, reward 1 for the right final integer) instead of GSM8K (Hub);
- config values sized for a 2-core CPU: problems per batch, group size, max tokens, steps, learning rate, LoRA rank.

Start the service first (another terminal), then run this::

    spinwheel tinker --model smollm2-135m-instruct --port 8000 --run-dir /tmp/tinker-run
    TINKER_API_KEY=tml-local python examples/tinker/rl_cookbook.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import os
import tempfile

import chz
from tinker_cookbook.recipes import rl_basic
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train

RENDERER = "qwen3_instruct"  # ChatML, as SmolLM2's chat template


def default_model() -> str:
    from spinwheel.models.hub import resolve_model_path

    return str(resolve_model_path("smollm2-135m-instruct"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000"))
    ap.add_argument("--model-name", default=None, help="base model: a local directory with the tokenizer")
    ap.add_argument("--batch-size", type=int, default=4, help="problems per step")
    ap.add_argument("--group-size", type=int, default=4, help="samples per problem")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--learning-rate", type=float, default=2e-4)
    ap.add_argument("--log-path", default=None)
    args = ap.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    model_name = args.model_name or default_model()
    builder = ArithmeticDatasetBuilder(
        batch_size=args.batch_size,
        group_size=args.group_size,
        renderer_name=RENDERER,
        model_name_for_tokenizer=model_name,
        n_batches=args.steps,
    )
    config = chz.Blueprint(train.Config).apply(
        {  # rl_basic's values, then the swaps above
            "model_name": model_name,
            "recipe_name": "recipe_rl_basic",
            "renderer_name": RENDERER,
            "log_path": args.log_path or os.path.join(tempfile.mkdtemp(prefix="rl_basic-"), "run"),
            "dataset_builder": builder,
            "learning_rate": args.learning_rate,
            "max_tokens": args.max_tokens,
            "eval_every": 0,
            "base_url": args.base_url,
            "lora_rank": args.lora_rank,
        }
    )
    rl_basic.main(config.make())


if __name__ == "__main__":
    main()
