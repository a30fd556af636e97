"""tinker-cookbook's ``sl_basic`` recipe, unchanged, against ``spinwheel tinker``.

The recipe's ``main`` and the cookbook's supervised training loop (``tinker_cookbook.supervised.train``) run as
published; what differs from ``sl_basic.build_config_blueprint`` is only what the issue allows to differ here:

- the model: SmolLM2-135M-Instruct from its local directory (the cookbook loads the tokenizer with
  ``AutoTokenizer.from_pretrained(model_name)``, so the name is the directory; the service accepts it as base_model);
- the renderer, given by name: the cookbook knows no SmolLM2 (``model_info`` raises "Unknown model"), and
  ``qwen3_instruct`` renders the same ChatML tokens as SmolLM2's chat template (``<|im_start|>role\\n...<|im_end|>``;
  the template's default system prompt is the one difference: add a system message to the data to get it);
- the dataset: the cookbook's own local ``example_data/conversations.jsonl`` (128 conversations) through
  ``FromConversationFileBuilder``, the swap ``sl_basic`` itself shows, instead of HuggingFaceH4/no_robots (Hub);
- config values sized for a 2-core CPU: batch size, max length, steps, LoRA rank.

Start the service first (another terminal), then run this::

    spinwheel tinker --model smollm2-135m-instruct --port 8000 --run-dir /tmp/tinker-run
    TINKER_API_KEY=tml-local python examples/tinker/sl_cookbook.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import chz
import tinker_cookbook
from tinker_cookbook.recipes import sl_basic
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

RENDERER = "qwen3_instruct"  # ChatML, as SmolLM2's chat template


def default_model() -> str:
    from spinwheel.models.hub import resolve_model_path

    return str(resolve_model_path("smollm2-135m-instruct"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000"))
    ap.add_argument("--model-name", default=None, help="base model: a local directory with the tokenizer")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--max-steps", type=int, default=16)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--learning-rate", type=float, default=2e-4)
    ap.add_argument("--log-path", default=None)
    args = ap.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    model_name = args.model_name or default_model()
    data = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model_name,
        renderer_name=RENDERER,
        max_length=args.max_length,
        batch_size=args.batch_size,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    config = chz.Blueprint(train.Config).apply(
        {  # sl_basic's values, then the swaps above
            "log_path": args.log_path or os.path.join(tempfile.mkdtemp(prefix="sl_basic-"), "run"),
            "model_name": model_name,
            "recipe_name": "recipe_sl_basic",
            "renderer_name": RENDERER,
            "dataset_builder": FromConversationFileBuilder(common_config=common, file_path=str(data), test_size=16),
            "learning_rate": args.learning_rate,
            "lr_schedule": "linear",
            "num_epochs": 1,
            "eval_every": 8,
            "base_url": args.base_url,
            "lora_rank": args.lora_rank,
            "max_steps": args.max_steps,
        }
    )
    sl_basic.main(config.make())


if __name__ == "__main__":
    main()
