"""Fixtures shared by several test modules (plain helpers are in ``helpers.py``). Session-scoped ones are built once
per run: nothing a test does changes them."""

import os

import pytest
import torch
from helpers import MODEL, REWARD_MODULE, TINY_LLAMA_EOS, TINY_LLAMA_VOCAB, engine_spec, reference

# Tests are small; one thread each avoids oversubscribing the 2-core CI machine.
torch.set_num_threads(int(os.environ.get("SPINWHEEL_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random tiny HF Llama (2 layers, GQA 4 on 2, vocab 96, EOS 2) saved as an HF checkpoint: (path, model).
    Its weights are spread wider than the default init so next-token distributions stay away from near-ties.
    Tests never move, cast or train the model."""
    import transformers  # the reference implementation (a test dependency)

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=TINY_LLAMA_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=TINY_LLAMA_EOS,
        pad_token_id=0,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a larger init spreads the next-token distribution away from near-ties
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="session")
def fidelity_refs():
    """The parallel fidelity oracle: single-process training for (tied, clip) in each combination."""
    return {(tied, clip): reference(tied, clip) for tied in (False, True) for clip in (False, True)}


@pytest.fixture
def digit_reward(tmp_path, monkeypatch):
    """The RL tests' reward module ``rl_test_reward:digits`` on this process's path and on spawned ranks'."""
    (tmp_path / "rl_test_reward.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="session")
def engine_process_server():
    """The server with its engine in its own process (`serve`'s default; 96 blocks of 4 tokens), for the end-to-end
    tests marked BOTH_ENGINE_MODES and test_server_engine_process."""
    from spinwheel.server import BackgroundServer, OpenAIServer
    from spinwheel.server.engine_client import EngineProcess

    with BackgroundServer(OpenAIServer(EngineProcess(engine_spec()), MODEL)) as bs:
        yield bs
