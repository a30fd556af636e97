import os

import pytest
import torch

# Tests are small; one thread each avoids oversubscribing the 2-core CI machine.
torch.set_num_threads(int(os.environ.get("SPINWHEEL_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tiny_engine_model(max_position_embeddings: int):
    """The engine tests' model: 2 layers, grouped-query attention (4 heads on 2 KV heads), vocab 100, EOS 2."""
    from spinwheel.models import ModelConfig, Transformer

    cfg = ModelConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=2,
    )
    return Transformer(cfg).init_weights(seed=0, std=0.1)
