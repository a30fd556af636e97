"""Multi-tenant batching in ``spinwheel tinker``: four clients' forward_backward calls in one batch (each row through
its own adapter) equal each client alone — the gradients (trainer) and, through the official SDK, the adapters after
forward_backward + optim_step; the RL losses equal Tinker's documented formulas on the returned log-probs."""

import os
import threading
import time

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from spinwheel.models.lora import LoRAConfig  # noqa: E402
from spinwheel.tinker.serve import BackgroundTinker, TinkerConfig, build_service  # noqa: E402
from spinwheel.tinker.service import Job  # noqa: E402
from spinwheel.tinker.wire import Datum, FwdBwdRequest  # noqa: E402

SEQS = [[1, 20, 21, 22, 23, 24, 25, 26, 27, 2], [1, 40, 41, 42, 43, 2], [1, 30, 31, 32, 33, 34, 35, 2], [1, 9, 8, 2]]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    service = build_service(TinkerConfig(model="tiny", run_dir=str(tmp_path_factory.mktemp("run")), device="cpu"))
    yield service
    service.close()


def request(client: str, loss: str, seqs: list[list[int]], seed: int) -> FwdBwdRequest:
    gen = torch.Generator().manual_seed(seed)
    data = []
    for s in seqs:
        n = len(s) - 1
        inputs = {"target_tokens": torch.tensor(s[1:]), "weights": torch.rand(n, generator=gen)}
        if loss != "cross_entropy":
            inputs["logprobs"] = -4 + torch.rand(n, generator=gen)
            inputs["advantages"] = torch.randn(n, generator=gen)
        data.append(Datum(s[:-1], inputs))
    return FwdBwdRequest(client, 1, loss, {}, False, data)


def grads(trainer, client: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in trainer.client(client).params.items():
        out[name] = p.grad.clone()
        p.grad = None
    return out


def test_four_clients_in_one_batch_equal_each_alone(svc):
    trainer = svc.trainer
    losses = ["cross_entropy", "importance_sampling", "ppo", "cross_entropy"]
    reqs = []
    for i, loss in enumerate(losses):
        # some projections are not adapted by every client
        targets = (("q", "v", "down"), ("q",), ("up", "down"), ("q", "v", "down"))[i]
        trainer.create(f"c{i}", LoRAConfig(rank=4 + i, alpha=32.0, targets=targets), seed=i)
        with torch.no_grad():  # a nonzero B, so every client's adapter changes its outputs
            for name, p in trainer.client(f"c{i}").params.items():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        reqs.append(request(f"c{i}", loss, SEQS[i:] + SEQS[:i], seed=i))
    rows = [r for i, req in enumerate(reqs) for r in trainer.rows(i, req)]
    batched = trainer.forward_backward(rows, len(reqs), backward=True)
    batched_grads = {f"c{i}": grads(trainer, f"c{i}") for i in range(4)}
    for i, req in enumerate(reqs):
        ((outputs, loss),) = trainer.forward_backward(trainer.rows(0, req), 1, backward=True)
        assert batched[i][1] == pytest.approx(loss, rel=1e-6, abs=1e-6)
        for a, b in zip(batched[i][0], outputs):
            torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=0, atol=1e-6)
        alone = grads(trainer, f"c{i}")
        for name, g in alone.items():
            torch.testing.assert_close(batched_grads[f"c{i}"][name], g, rtol=1e-5, atol=1e-6, msg=name)
        # the loss is Tinker's formula on the returned log-probs
        expected = 0.0
        for d, out in zip(req.data, outputs):
            lp, x = out["logprobs"].double().numpy(), {k: v.double().numpy() for k, v in d.inputs.items()}
            if req.loss_fn == "cross_entropy":
                expected += float(np.sum(-x["weights"] * lp))
            else:
                ratio = np.exp(lp - x["logprobs"])
                objective = ratio * x["advantages"]
                if req.loss_fn == "ppo":
                    objective = np.minimum(objective, np.clip(ratio, 0.8, 1.2) * x["advantages"])
                expected += float(np.sum(-objective))
        assert loss == pytest.approx(expected, rel=1e-5)


def _clients_with_grads(trainer, prefix: str) -> list:
    """Four clients (ranks 2..5) with the same seeded factors and gradients whatever the prefix."""
    out = []
    for i in range(4):
        c = trainer.create(f"{prefix}{i}", LoRAConfig(rank=2 + i, alpha=16.0, targets=("q", "up")), seed=20 + i)
        gen = torch.Generator().manual_seed(100 + i)
        for p in c.params.values():
            p.grad = torch.randn(p.shape, generator=gen) * (0.1 + i)
        out.append(c)
    return out


def test_optim_steps_of_four_clients_in_one_fused_adamw_equal_each_alone_and_torch_adamw(svc):
    from spinwheel.tinker.optim import AdamHP, adamw_steps

    hps = [AdamHP(lr=1e-2), AdamHP(lr=1e-2), AdamHP(lr=3e-3, beta2=0.99, weight_decay=0.1), AdamHP(grad_clip_norm=0.5)]
    together, alone = _clients_with_grads(svc.trainer, "t"), _clients_with_grads(svc.trainer, "a")
    ref = {}  # torch.optim.AdamW on copies of the factors, as a plain LoRA step computes
    for i, (c, hp) in enumerate(zip(alone, hps)):
        params = {k: torch.nn.Parameter(p.detach().clone()) for k, p in c.params.items()}
        opt = torch.optim.AdamW(params.values(), lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                                weight_decay=hp.weight_decay)  # fmt: skip
        for _ in range(2):
            for k, p in params.items():
                p.grad = c.params[k].grad.clone()
            if hp.grad_clip_norm:
                torch.nn.utils.clip_grad_norm_(list(params.values()), hp.grad_clip_norm)
            opt.step()
        ref[i] = params
    for step in range(2):
        grads_now = [{k: p.grad.clone() for k, p in c.params.items()} for c in alone]
        batched = adamw_steps(list(zip(together, hps)))
        each = [adamw_steps([(c, hp)])[0] for c, hp in zip(alone, hps)]
        assert [m["grad_norm:mean"] for m in batched] == pytest.approx([m["grad_norm:mean"] for m in each], 1e-6)
        for i, (a, b) in enumerate(zip(together, alone)):
            assert a.num_steps == b.num_steps == step + 1 and all(p.grad is None for p in a.params.values())
            for k in a.params:
                torch.testing.assert_close(a.params[k].detach(), b.params[k].detach(), rtol=0, atol=1e-6)
                a.params[k].grad, b.params[k].grad = grads_now[i][k].clone(), grads_now[i][k].clone()
    for i, c in enumerate(alone):
        for k, p in c.params.items():
            torch.testing.assert_close(p.detach(), ref[i][k].detach(), rtol=0, atol=1e-6, msg=k)
        state = c.optimizer.state_dict()["state"][0]  # torch's own AdamW state layout, as save_state writes it
        assert float(state["step"]) == 2 and set(state) == {"step", "exp_avg", "exp_avg_sq"}


def test_the_worker_runs_optim_steps_of_waiting_clients_together(svc):
    from spinwheel.tinker.optim import AdamHP

    clients = _clients_with_grads(svc.trainer, "w")
    release = threading.Event()
    svc.worker.submit("hold", Job(svc.store.create(), call=lambda: release.wait(30)))
    rids = [svc.submit(c.client, optim=(c.client, AdamHP(lr=1e-3))) for c in clients]
    rids.append(svc.submit("w9", optim=("w9", AdamHP())))  # an unknown client fails alone
    release.set()
    outcomes = [svc.store.poll(rid, 30) for rid in rids]
    assert all(o is not None and o.error is None for o in outcomes[:4])
    assert "no training client 'w9'" in outcomes[4].error and outcomes[4].category == "user"
    assert 4 in svc.worker.optim_batch_sizes


def test_a_forward_backward_batch_waits_a_moment_for_clients_between_two_steps(svc):
    worker = svc.worker
    for name in ("g0", "g1", "g2"):
        svc.trainer.create(name, LoRAConfig(rank=2, alpha=16.0, targets=("q",)), seed=0)
    old, worker.gather_s = worker.gather_s, 5.0
    try:
        now = time.monotonic()
        with worker._cond:  # g0 and g1 just stepped (as after their optim_step): the next batch waits for both
            worker._last_step = {"g0": now, "g1": now}
        before = len(worker.batch_sizes)
        first = svc.forward_backward(request("g0", "cross_entropy", SEQS[:1], 0))
        time.sleep(0.2)  # g1's request comes later, inside the window
        second = svc.forward_backward(request("g1", "cross_entropy", SEQS[1:2], 1))
        assert all(svc.store.poll(rid, 30).error is None for rid in (first, second))
        assert worker.batch_sizes[before] == 2
        worker.gather_s = 0.3  # g2 stepped and then went quiet: the batch runs without it once the window ends
        with worker._cond:
            worker._last_step["g2"] = time.monotonic()
        start = time.monotonic()
        assert svc.store.poll(svc.forward_backward(request("g0", "cross_entropy", SEQS[:1], 0)), 30).error is None
        assert 0.25 < time.monotonic() - start < 20 and worker.batch_sizes[-1] == 1
    finally:
        worker.gather_s = old


def datum(ids: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64), "weights": np.ones(len(ids) - 1, np.float32)},
    )


def test_sdk_clients_batched_together_equal_each_alone(svc):
    with BackgroundTinker(svc) as bg:
        sdk = tinker.ServiceClient(base_url=bg.url)
        together = [sdk.create_lora_training_client(base_model="tiny", rank=4, seed=10 + i).result() for i in range(4)]
        alone = [sdk.create_lora_training_client(base_model="tiny", rank=4, seed=10 + i).result() for i in range(4)]
        adam = types.AdamParams(learning_rate=1e-2)
        # hold the worker so that the four forward_backward calls queue up and run as one batch
        release = threading.Event()
        svc.worker.submit("hold", Job(svc.store.create(), call=lambda: release.wait(30)))
        before = len(svc.worker.batch_sizes)
        futures = [c.forward_backward([datum(SEQS[i])], "cross_entropy") for i, c in enumerate(together)]
        deadline = time.monotonic() + 20
        while sum(len(svc.worker.queues.by_model.get(c.model_id, ())) for c in together) < 4:
            assert time.monotonic() < deadline, "the forward_backward calls did not arrive"
            time.sleep(0.01)
        release.set()
        for f in futures:
            f.result()
        assert svc.worker.batch_sizes[before] == 4
        for c in together:
            c.optim_step(adam).result()
        for i, c in enumerate(alone):
            c.forward_backward([datum(SEQS[i])], "cross_entropy").result()
            c.optim_step(adam).result()
        for a, b in zip(together, alone):
            pa, pb = svc.trainer.client(a.model_id).params, svc.trainer.client(b.model_id).params
            for name in pa:
                torch.testing.assert_close(pa[name].detach(), pb[name].detach(), rtol=0, atol=1e-6, msg=name)
