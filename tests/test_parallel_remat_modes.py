"""Re-materialisation modes: the bytes autograd holds after forward match each mode's formula, and losses and gradients
equal the run without re-materialisation (fp32).

Notation: L blocks, a micro-batch of B rows × T tokens, hidden size C, head dim D, fp32 (4 bytes). A block's input
is X = 4·B·T·C bytes; the rotary tables cos and sin, computed once per forward and shared by every block, are
R = 2·4·B·T·D. Let A be what one block saves for backward besides cos/sin (measured on one block alone). Counting
each storage once and leaving parameters out, what the block stack holds after forward is

* ``none``:     L·A + R — every block's internal activations;
* ``block``:    L·X + R — each checkpoint keeps its block's input (and the shared cos/sin it was called with);
* ``every-k``:  ⌈L/k⌉·X + R — one input per segment of k blocks (default k = round(√L));

so, cos/sin aside, block / none = X / A and every-k / block = ⌈L/k⌉ / L. Under GPipe's ``stage`` mode (pipeline of
K = 2 stages, micro-batches of b rows), stage s holds, for each of its m in-flight micro-batches (m = M under GPipe,
K − s under 1F1B), its input alone: m·8·b·T bytes of token ids on the first stage, m·4·b·T·C of hidden states on
the second (the loss, computed outside the stage, is not counted).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from spinwheel.cli import build_parser, main
from spinwheel.models.presets import preset_config
from spinwheel.models.transformer import AttentionMask, Transformer, run_blocks
from spinwheel.parallel import ParallelConfig, ParallelDims, spawn
from spinwheel.parallel.pipeline import PipelineSchedule, PipelineStage
from spinwheel.parallel.remat import SavedBytes, apply_remat, default_segment_size, segment_ranges
from spinwheel.parallel.remat_partition import WholeInput
from spinwheel.parallel.remat_region import CheckpointRegion

VOCAB, B, T, L = 64, 3, 10, 6
CONFIG = preset_config("test", VOCAB, num_hidden_layers=L)
C, D = CONFIG.hidden_size, CONFIG.head_dim
X, R = 4 * B * T * C, 2 * 4 * B * T * D


def make_model(mode: str = "none", k: int | None = None) -> Transformer:
    model = Transformer(CONFIG).init_weights(seed=1)
    if mode != "none":
        apply_remat(model, mode, k)
    return model


def block_stack_bytes(model: Transformer) -> int:
    """Bytes autograd holds after the forward of the block stack on a fresh hidden input (B, T, C)."""
    h = torch.randn(B, T, C, generator=torch.Generator().manual_seed(3), requires_grad=True)
    positions = torch.arange(T).expand(B, T)
    with SavedBytes(exclude=model.parameters()) as saved:
        out = run_blocks(model.layers, model.rotary, h, positions, AttentionMask(None))
    out.sum().backward()  # the recomputation must also run
    return saved.nbytes


def one_block_bytes() -> int:
    """A: what one block saves besides the cos/sin it is given (and its parameters)."""
    model = make_model()
    positions = torch.arange(T).expand(B, T)
    cos, sin = model.rotary(positions, torch.float32)
    h = torch.randn(B, T, C, requires_grad=True)
    with SavedBytes(exclude=[*model.parameters(), cos, sin]) as saved:
        model.layers[0](h, cos, sin, AttentionMask(None))
    return saved.nbytes


def test_segments_follow_the_square_root_rule():
    assert [default_segment_size(n) for n in (1, 2, 4, 6, 9, 12)] == [1, 1, 2, 2, 3, 3]
    assert segment_ranges(6, 4) == [range(0, 4), range(4, 6)]
    assert len(segment_ranges(L, default_segment_size(L))) == math.ceil(L / round(math.sqrt(L)))
    with pytest.raises(ValueError, match="already re-materialised"):
        apply_remat(make_model("block"), "every-k")


@pytest.mark.parametrize(
    "mode,k,checkpoints",
    [("block", None, L), ("every-k", None, math.ceil(L / 2)), ("every-k", 4, 2), ("every-k", 1, L)],
)
def test_stored_bytes_match_the_formula(mode, k, checkpoints):
    a = one_block_bytes()
    none = block_stack_bytes(make_model())
    assert none == L * a + R
    stored = block_stack_bytes(make_model(mode, k))
    assert stored == checkpoints * X + R, (mode, k, stored, checkpoints * X + R)
    assert (stored - R) / (none - R) == pytest.approx(checkpoints * X / (L * a), rel=1e-12)
    assert (stored - R) / (L * X) == pytest.approx(checkpoints / L, rel=1e-12)


def loss_and_grads(model: Transformer, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode,k", [("block", None), ("every-k", None), ("every-k", 4), ("every-k", 6)])
def test_losses_and_gradients_equal_no_remat(mode, k):
    ids = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(4))
    ref_loss, ref_grads = loss_and_grads(make_model(), ids)
    loss, grads = loss_and_grads(make_model(mode, k), ids)
    assert loss == pytest.approx(ref_loss, rel=1e-7)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-9, msg=name)


def test_retained_graph_recomputes_for_each_backward():
    ids = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(4))
    grads = {}
    for mode in ("none", "every-k"):
        model = make_model(mode)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward(retain_graph=True)
        loss.backward()  # the second backward needs every saved tensor again
        grads[mode] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["every-k"][name], g, rtol=1e-6, atol=1e-9, msg=name)


def test_a_failing_forward_leaves_no_region_open():
    model = make_model("every-k")
    mlp = model.layers[0].mlp

    def fail(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    mlp.forward = fail  # inside the first segment, after its region opened
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randint(0, VOCAB, (B, T)))
    del mlp.forward
    # A region left open would capture the saves of this plain model's forward (and then fail its backward).
    ids = torch.randint(0, VOCAB, (B, T + 1), generator=torch.Generator().manual_seed(4))
    ref_loss, ref_grads = loss_and_grads(make_model(), ids)
    loss, grads = loss_and_grads(model, ids)
    assert loss == pytest.approx(ref_loss, rel=1e-7)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-9, msg=name)


def test_a_recomputation_that_saves_differently_is_refused():
    calls = []

    def region_fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x.sin() if len(calls) == 1 else x.sin().exp()  # the recomputation saves one tensor more

    x = torch.randn(4, requires_grad=True)
    region = CheckpointRegion(region_fn, WholeInput(), (x,))
    region.enter()
    try:
        y = region_fn(x)
    finally:
        region.exit()
    assert region.num_saved == 1
    with pytest.raises(RuntimeError, match="recomputation saved 2 tensors where the forward saved 1"):
        y.sum().backward()


def test_no_grad_forward_runs_plainly():
    ids = torch.randint(0, VOCAB, (B, T))
    with torch.no_grad():
        torch.testing.assert_close(make_model("every-k")(ids), make_model()(ids), rtol=0, atol=0)


M, ROWS = 4, 2  # micro-batches, rows per micro-batch


def pipeline_run(rank: int, world_size: int, mode: str, schedule: str) -> dict:
    """One pipeline step of the 2-stage model in ``mode``: peak stored bytes, the loss and this stage's gradients."""
    dims = ParallelDims.create(pp=2)
    model = Transformer(preset_config("test", VOCAB, num_hidden_layers=4)).init_weights(seed=1)
    stage = PipelineStage(model, dims.pp_axis.rank, 2)
    if mode != "none":
        apply_remat(stage, mode)
    sched = PipelineSchedule(stage, dims.pp_axis, dims.comm, schedule, track_activations=True)
    ids = torch.randint(0, VOCAB, (M * ROWS, T), generator=torch.Generator().manual_seed(5))
    microbatches = [mb.clone() for mb in ids.chunk(M)]  # own storages: a chunk view would count all of ids
    loss = sched.step(microbatches, lambda logits, i: logits.float().pow(2).mean())
    grads = {n: p.grad.numpy().copy() for n, p in stage.named_parameters()}  # tensors would go by fd
    return {"peak": sched.stats.peak_activation_bytes, "loss": float(loss), "grads": grads}


def pipeline_reference() -> tuple[float, dict[str, torch.Tensor]]:
    model = Transformer(preset_config("test", VOCAB, num_hidden_layers=4)).init_weights(seed=1)
    ids = torch.randint(0, VOCAB, (M * ROWS, T), generator=torch.Generator().manual_seed(5))
    loss = sum(model(mb).float().pow(2).mean() for mb in ids.chunk(M))
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def pipeline_runs(rank: int, world_size: int) -> dict[tuple[str, str], dict]:
    """:func:`pipeline_run` for each (mode, schedule), in one spawned world."""
    return {(m, schedule): pipeline_run(rank, world_size, m, schedule) for m in MODES for schedule in SCHEDULES}


MODES, SCHEDULES = ("none", "stage"), ("gpipe", "1f1b")


@pytest.fixture(scope="module")
def runs() -> list[dict[tuple[str, str], dict]]:
    return spawn(pipeline_runs, 2, timeout_s=240)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stage_mode_keeps_only_each_stage_input(schedule, runs):
    none = [r["none", schedule] for r in runs]
    stage = [r["stage", schedule] for r in runs]
    in_flight = M if schedule == "gpipe" else (2, 1)  # 1F1B: K − s micro-batches in flight on stage s
    for s, (plain, remat) in enumerate(zip(none, stage)):
        flights = in_flight if isinstance(in_flight, int) else in_flight[s]
        input_bytes = 8 * ROWS * T if s == 0 else 4 * ROWS * T * C  # token ids (int64) / hidden states (fp32)
        assert remat["peak"] == flights * input_bytes, (s, remat["peak"])
        assert plain["peak"] > 10 * remat["peak"]
    ref_loss, ref_grads = pipeline_reference()
    assert stage[1]["loss"] == pytest.approx(ref_loss, rel=1e-6)
    for res in stage:
        for name, g in res["grads"].items():
            torch.testing.assert_close(torch.from_numpy(g), ref_grads[name], rtol=1e-5, atol=1e-8, msg=name)


def test_mode_choices_are_checked_in_one_line():
    assert ParallelConfig(remat=True).remat == "block" and ParallelConfig(remat=False).remat == "none"
    with pytest.raises(ValueError, match="--remat stage keeps only each pipeline stage's input: it needs --pp > 1"):
        ParallelConfig(remat="stage")
    with pytest.raises(ValueError, match="needs --remat every-k"):
        ParallelConfig(remat="block", remat_k=2)
    with pytest.raises(ValueError, match="--remat must be one of"):
        ParallelConfig(remat="sometimes")
    ParallelConfig(remat="stage", pp=2)
    ParallelConfig(remat="every-k", remat_k=3)


def test_cli_spells_the_modes_and_refuses_what_cannot_run(tmp_path, capsys):
    parse = build_parser().parse_args
    assert parse(["sft", "--remat"]).remat == "block"  # the old flag
    assert parse(["sft", "--no-remat"]).remat == "none"
    ns = parse(["sft", "--remat", "every-k", "--remat-k", "3", "--remat-partition", "tp-cpu"])
    assert (ns.remat, ns.remat_k, ns.remat_partition) == ("every-k", 3, "tp-cpu")
    for argv, message in [
        (["--remat", "stage"], "--remat stage keeps only each pipeline stage's input: it needs --pp > 1"),
        (["--remat", "--remat-partition", "tp"], "--remat-partition tp splits checkpoints across the tensor-parallel"),
    ]:
        assert main(["sft", *argv, "--out-dir", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and message in err, err
