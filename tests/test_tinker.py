"""``spinwheel tinker`` driven by the official ``tinker`` SDK (a test dependency: the `tinker` extra) on a loopback
port: a LoRA trains (loss falls) and samples from its saved weights; one forward_backward + optim_step equals a plain
PyTorch LoRA step on spinwheel's LoRALinear (adapters to 1e-6); gradient accumulation over several calls equals one
call; the sampler's log-probs equal the trainer's; saved state resumes in a restarted service; a bad request fails
alone with the SDK's RequestFailedError (category user)."""

import os

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from spinwheel.models import load_model  # noqa: E402
from spinwheel.models.lora import LoRAConfig, apply_lora, lora_parameters  # noqa: E402
from spinwheel.tinker.serve import BackgroundTinker, TinkerConfig, build_service  # noqa: E402

MODEL = "tiny"
RANK = 4
ALPHA = 32.0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tinker-run")


@pytest.fixture(scope="module")
def service(run_dir):
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    svc = build_service(TinkerConfig(model=MODEL, run_dir=str(run_dir), device="cpu", lora_alpha=ALPHA))
    with BackgroundTinker(svc) as bg:
        yield bg


@pytest.fixture(scope="module")
def sdk(service):
    return tinker.ServiceClient(base_url=service.url)


def datum(ids: list[int], weights: list[float] | None = None) -> types.Datum:
    n = len(ids) - 1
    w = np.ones(n, np.float32) if weights is None else np.asarray(weights, np.float32)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64), "weights": w},
    )


SEQS = [[1, 20, 21, 22, 23, 24, 25, 26, 27, 2], [1, 40, 41, 42, 43, 2], [1, 30, 31, 32, 33, 34, 35, 2]]


def adapter(service, client) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in service.service.trainer.client(client.model_id).params.items()}


def test_sdk_trains_a_lora_and_samples_from_its_weights(sdk):
    tc = sdk.create_lora_training_client(base_model=MODEL, rank=RANK, seed=1).result()
    data = [datum(s) for s in SEQS]
    losses = []
    for _ in range(12):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=3e-3))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    assert losses[-1] < 0.75 * losses[0], losses  # the random tiny preset: ~97 -> ~64
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = SEQS[0][:4]
    params = types.SamplingParams(max_tokens=5, temperature=0.0, stop=[])
    out = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params).result()
    assert len(out.sequences) == 2
    seq = out.sequences[0]
    assert len(seq.tokens) == 5 and seq.stop_reason == "length" and seq.tokens == out.sequences[1].tokens
    # the sampler runs the trained adapter: its log-probs are the training client's forward on the same tokens
    full = prompt + seq.tokens
    fwd = tc.forward([datum(full)], "cross_entropy").result()
    trained = fwd.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :]
    np.testing.assert_allclose(seq.logprobs, trained, atol=1e-4)


def reference_step(seed: int, seqs: list[list[int]], lr: float, wd: float) -> tuple[float, dict]:
    """One LoRA step in plain PyTorch on spinwheel's LoRALinear: loss = sum of -log p(target), AdamW."""
    model = load_model(MODEL)
    apply_lora(model, LoRAConfig(rank=RANK, alpha=ALPHA), seed=seed)
    params = lora_parameters(model)
    opt = torch.optim.AdamW(list(params.values()), lr=lr, betas=(0.9, 0.95), eps=1e-12, weight_decay=wd)
    total = 0.0
    for s in seqs:
        ids = torch.tensor(s)
        logp = torch.log_softmax(model(ids[None, :-1]).float(), -1)[0].gather(-1, ids[1:, None])[:, 0]
        loss = -logp.sum()
        loss.backward()
        total += float(loss.detach())
    opt.step()
    return total, {k: p.detach() for k, p in params.items()}


def test_one_step_equals_a_plain_pytorch_lora_step(service, sdk):
    tc = sdk.create_lora_training_client(base_model=MODEL, rank=RANK, seed=7).result()
    fb = tc.forward_backward([datum(s) for s in SEQS], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2, weight_decay=0.1)).result()
    loss, ref = reference_step(7, SEQS, lr=1e-2, wd=0.1)
    assert fb.result().metrics["loss:sum"] == pytest.approx(loss, rel=1e-6)
    got = adapter(service, tc)
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


def test_accumulation_over_calls_equals_one_call(service, sdk):
    one = sdk.create_lora_training_client(base_model=MODEL, rank=RANK, seed=3).result()
    many = sdk.create_lora_training_client(base_model=MODEL, rank=RANK, seed=3).result()
    one.forward_backward([datum(s) for s in SEQS], "cross_entropy")
    one.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    for s in SEQS:
        many.forward_backward([datum(s)], "cross_entropy")
    many.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    a, b = adapter(service, one), adapter(service, many)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


def test_bad_requests_fail_alone_with_the_sdk_error(service, sdk):
    tc = sdk.create_lora_training_client(base_model=MODEL, rank=RANK).result()
    short = types.Datum(
        model_input=types.ModelInput.from_ints(SEQS[0][:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(SEQS[0][1:], np.int64), "weights": np.ones(3, np.float32)},
    )
    vocab = service.service.model.config.vocab_size
    cases = [
        (lambda: tc.forward_backward([short], "cross_entropy"), "shape [3]"),
        (lambda: tc.forward_backward([datum(SEQS[0])], "cispo"), "unknown loss_fn 'cispo'"),
        (lambda: tc.forward_backward([datum([1, vocab + 5, 3])], "cross_entropy"), f"token id {vocab + 5}"),
        (lambda: tc.forward_backward([datum(SEQS[0])], "ppo"), "needs loss_fn_inputs 'logprobs'"),
    ]
    for call, message in cases:
        with pytest.raises(tinker.RequestFailedError) as err:
            call().result()
        assert message in str(err.value) and err.value.category == "user"
    # the client (and the service) go on
    assert tc.forward_backward([datum(SEQS[1])], "cross_entropy").result().metrics["loss:sum"] > 0
    with pytest.raises(tinker.RequestFailedError, match="not a tinker:// path"):
        tc.load_state("/etc/passwd").result()


def test_state_resumes_in_a_restarted_service(service, sdk, run_dir):
    tc = sdk.create_lora_training_client(base_model=MODEL, rank=RANK, seed=5).result()
    adam = types.AdamParams(learning_rate=1e-2)
    for _ in range(2):
        tc.forward_backward([datum(s) for s in SEQS], "cross_entropy")
        tc.optim_step(adam).result()
    path = tc.save_state("two").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/two")
    tc.forward_backward([datum(SEQS[0])], "cross_entropy")
    tc.optim_step(adam).result()
    expected = adapter(service, tc)

    restarted = build_service(TinkerConfig(model=MODEL, run_dir=str(run_dir), device="cpu", lora_alpha=ALPHA))
    with BackgroundTinker(restarted) as bg:
        again = tinker.ServiceClient(base_url=bg.url)
        resumed = again.create_training_client_from_state_with_optimizer(path).result()
        resumed.forward_backward([datum(SEQS[0])], "cross_entropy")
        resumed.optim_step(adam).result()
        got = adapter(bg, resumed)
        weights_only = again.create_training_client_from_state(path).result()
        assert bg.service.trainer.client(weights_only.model_id).num_steps == 0
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)
