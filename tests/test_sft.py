"""SFT trainer: the loss formula, batching, LR schedule, atomic checkpoints and exact resume."""

import math

import pytest
import torch

from spinwheel.models.tokenizer import Tokenizer
from spinwheel.tasks.arithmetic import ArithmeticConfig
from spinwheel.tasks.data import SAMPLES_DIR
from spinwheel.train.metrics import read_metrics
from spinwheel.train.optim import lr_at
from spinwheel.train.sft.sft import train_sft
from spinwheel.train.sft.sft_config import SFTConfig
from spinwheel.train.sft.sft_data import SFTExample, batch_indices, build_data, collate, completion_loss


def test_completion_loss_matches_hand_written_formula():
    logits = torch.randn(2, 6, 9)
    ids = torch.randint(0, 9, (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    loss, stats = completion_loss(logits, ids, mask)
    total, count = 0.0, 0
    for b in range(2):
        for t in range(5):
            if mask[b, t]:
                total += -torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]].item()
                count += 1
    assert stats["num_tokens"] == count == 5
    assert loss.item() == pytest.approx(total / count, rel=1e-6)


def test_collate_masks_completion_tokens_only():
    a = SFTExample("1+1=", "2", (1, 10, 11, 12, 13), (14, 2))
    b = SFTExample("9=", "9", (1, 20, 21), (22, 23, 2))
    batch = collate([a, b], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 10, 11, 12, 13, 14, 2], [1, 20, 21, 22, 23, 2, 0]]
    # mask[t] = 1 when input_ids[t + 1] is a completion token (incl. EOS)
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 0]]


def test_batch_indices_cover_each_epoch_once_and_are_deterministic():
    n, bs = 10, 4
    first_epochs = [i for s in range(5) for i in batch_indices(s, bs, n, seed=3)]  # 20 = two epochs
    assert sorted(first_epochs[:10]) == list(range(10)) and sorted(first_epochs[10:]) == list(range(10))
    assert first_epochs[:10] != first_epochs[10:]
    assert batch_indices(2, bs, n, seed=3) == batch_indices(2, bs, n, seed=3)
    assert batch_indices(0, bs, n, seed=3) != batch_indices(0, bs, n, seed=4)


def test_lr_schedule_warmup_then_cosine():
    assert lr_at(0, 1.0, 10, 110, 0.1) == pytest.approx(0.1)
    assert lr_at(9, 1.0, 10, 110, 0.1) == pytest.approx(1.0)
    assert lr_at(10, 1.0, 10, 110, 0.1) == pytest.approx(1.0)
    assert lr_at(60, 1.0, 10, 110, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(110, 1.0, 10, 110, 0.1) == pytest.approx(0.1)
    assert lr_at(35, 1.0, 10, 110, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))


def _config(out_dir, **kw):
    base = dict(
        model="test",
        out_dir=str(out_dir),
        steps=12,
        batch_size=8,
        lr=3e-3,
        warmup_steps=2,
        eval_every=6,
        eval_examples=8,
        max_new_tokens=4,
        save_every=4,
        progress=False,
        task=ArithmeticConfig(num_digits=1, num_train=60, num_test=10),
    )
    base.update(kw)
    return SFTConfig(**base)


def _losses(out_dir):
    return [(r["step"], r["loss"]) for r in read_metrics(out_dir / "metrics.jsonl") if "loss" in r]


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path):
    full = train_sft(_config(tmp_path / "full"))
    assert len(full["losses"]) == 12
    part = train_sft(_config(tmp_path / "split", stop_after=5))
    assert part["end_step"] == 5 and "eval_after" not in part
    rest = train_sft(_config(tmp_path / "split"))
    assert rest["start_step"] == 5 and len(rest["losses"]) == 7
    assert _losses(tmp_path / "split") == _losses(tmp_path / "full")  # bit-identical, steps 1..12
    a = (tmp_path / "full" / "checkpoint" / "model.safetensors").read_bytes()
    b = (tmp_path / "split" / "checkpoint" / "model.safetensors").read_bytes()
    assert a == b


def test_checkpoint_is_a_complete_hf_directory(tmp_path):
    import transformers

    result = train_sft(_config(tmp_path, steps=4, eval_every=0))
    ckpt = tmp_path / "checkpoint"
    assert {p.name for p in ckpt.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "trainer_state.pt",
    }
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary dirs left
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    evals = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "eval_exact_match" in r]
    assert [r["step"] for r in evals] == [0, 4]
    assert result["eval_after"]["exact_match"] == evals[-1]["eval_exact_match"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    import spinwheel

    ours = spinwheel.load_model(ckpt)
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-5, rtol=1e-5)


def test_training_reduces_loss_on_jsonl_chat_data(tmp_path):
    cfg = _config(
        tmp_path, data=str(SAMPLES_DIR / "sft.jsonl"), steps=30, eval_every=0, eval_fraction=0.2, lr=1e-2, batch_size=4
    )
    data = build_data(cfg, Tokenizer.char_level())
    assert len(data.train) + len(data.eval) == 7 and len(data.eval) == 1
    assert any("<|assistant|>" in e.prompt for e in data.train + data.eval)  # messages rendered by the template
    bos = Tokenizer.char_level().bos_id
    assert all(e.prompt_ids[0] == bos and e.prompt_ids[1] != bos for e in data.train + data.eval)  # one BOS
    result = train_sft(cfg)
    assert result["losses"][-1] < 0.5 * result["losses"][0]


def test_engine_evaluation_equals_plain_generate(tmp_path):
    """The demo's evaluation runs on the serving engine; it must score exactly like the plain reference loop."""
    from spinwheel.models.hf import load_model
    from spinwheel.train.evaluation import engine_generate, heldout_eval, plain_generate

    cfg = _config(tmp_path, steps=30, eval_every=0, lr=1e-2, eval_examples=10)
    train_sft(cfg)
    model = load_model(tmp_path / "checkpoint")
    tok = Tokenizer.char_level()
    data = build_data(cfg, tok)
    ref = heldout_eval(plain_generate(model, tok), data, 10, 4)
    ours = heldout_eval(engine_generate(model, tok, 64), data, 10, 4)
    assert ours == ref
    assert any(c for _, c, _ in ref["samples"])  # non-empty completions were compared
