"""The engine's one seam to the model (spinwheel/engine/executor.py): the factory picks the executor by the TP and
PP degrees, and an executor a caller passes in (as the RL loop's ``--engine-tp`` does) runs every step, weight
update and adapter; its outputs equal the default executor's token for token and logprob for logprob."""

import copy

from helpers import random_adapter, server_model

import spinwheel
from spinwheel.engine import LLM, SamplingParams
from spinwheel.engine.executor import InProcessExecutor
from spinwheel.engine.executor_factory import EXECUTORS
from spinwheel.engine.parallel.pp_executor import PPExecutor
from spinwheel.engine.parallel.tp_executor import TPExecutor
from spinwheel.engine.parallel.tp_pp import TPPPExecutor

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


class Recording(InProcessExecutor):
    """The one-device executor, counting what the engine asks of it."""

    def __init__(self, model, config, max_model_len) -> None:
        super().__init__(model, config, max_model_len)
        self.calls = {"execute_model": 0, "update_weights": 0, "add_lora": 0}

    def execute_model(self, out):
        self.calls["execute_model"] += 1
        return super().execute_model(out)

    def update_weights(self, model_or_state_dict) -> None:
        self.calls["update_weights"] += 1
        super().update_weights(model_or_state_dict)

    def add_lora(self, name, path) -> None:
        self.calls["add_lora"] += 1
        super().add_lora(name, path)


def test_the_factory_picks_the_executor_by_the_degrees():
    assert EXECUTORS == {
        (False, False): InProcessExecutor,
        (True, False): TPExecutor,
        (False, True): PPExecutor,
        (True, True): TPPPExecutor,
    }


def _run(llm: LLM) -> list:
    greedy, seeded = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2), SamplingParams(seed=3, max_tokens=6)
    outs = llm.generate(PROMPTS, [greedy, seeded, greedy])
    outs += llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4, lora="a"))
    return [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in outs]


def test_an_executor_passed_in_runs_every_step_update_and_adapter(tmp_path):
    base = server_model()
    random_adapter(base, tmp_path / "a", 1, "q,v", 2)
    new = copy.deepcopy(base)
    for p in new.parameters():
        p.data.mul_(0.9)
    results = []
    for executor in (None, Recording):
        llm = LLM(copy.deepcopy(base), spinwheel.Tokenizer.char_level(), executor, num_kv_blocks=64, block_size=4)
        llm.add_lora("a", tmp_path / "a")
        before = _run(llm)
        llm.update_weights(new.state_dict())
        results.append((before, _run(llm)))
        if executor is not None:
            calls = llm.engine.executor.calls
            assert calls["add_lora"] == 1 and calls["update_weights"] == 1
            assert calls["execute_model"] >= 2 * 6  # every step of four generate calls of up to 6 tokens
        llm.close()
    assert results[0] == results[1]
    assert results[0][0] != results[0][1]  # the update changed the outputs
