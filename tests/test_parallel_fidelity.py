"""Every parallel layout trains exactly like one process: per-step losses and final parameters equal (fp32, relative
1e-5) to single-process training of the same model, data and global batch over ``STEPS`` (6) steps.

Layouts marked ``clip`` train as the SFT trainer does: a warmup + cosine learning rate set with ``trainer.set_lr``,
AdamW's decoupled weight decay on weight matrices only (``decays``) and global gradient-norm clipping with a max norm
small enough to clip every step; the global norms must equal ``torch.nn.utils.clip_grad_norm_``'s too.

Layouts are grouped into two spawned gloo worlds (2 and 4 CPU ranks) so the suite stays short; each rank trains every
layout of its world in turn and reports the largest relative errors, which the parent asserts. The oracle
(``reference``) and the per-rank runner (``run_layouts``) are in ``helpers.py``: the checkpoint and buffer tests use
them too.
"""

from __future__ import annotations

import pytest
from helpers import MAX_NORM, check_layouts, run_layouts

from spinwheel.parallel import spawn

LAYOUTS_2 = [
    ("ddp", dict()),
    ("ddp-accum-small-buckets", dict(microbatches=2, bucket_mb=0.01)),
    ("zero1", dict(zero=1, bucket_mb=0.02)),
    ("zero1-accum", dict(zero=1, microbatches=2)),
    ("zero2", dict(zero=2, bucket_mb=0.02)),
    ("zero3", dict(zero=3)),
    ("fsdp", dict(fsdp=True)),
    ("fsdp-tied", dict(fsdp=True, tied=True)),
    ("tp2", dict(tp=2)),
    ("tp2-tied", dict(tp=2, tied=True)),
    ("pp2-gpipe-m1", dict(pp=2, schedule="gpipe", microbatches=1)),
    ("pp2-gpipe-m4", dict(pp=2, schedule="gpipe", microbatches=4)),
    ("pp2-1f1b-m1", dict(pp=2, schedule="1f1b", microbatches=1)),
    ("pp2-1f1b-m4-tied", dict(pp=2, schedule="1f1b", microbatches=4, tied=True)),
    ("ddp-remat", dict(remat=True)),
    ("zero2-remat", dict(zero=2, remat=True)),
    ("zero3-remat", dict(zero=3, remat=True)),
    ("fsdp-remat", dict(fsdp=True, remat=True)),
    ("tp2-remat", dict(tp=2, remat=True)),
    ("pp2-gpipe-m4-remat", dict(pp=2, schedule="gpipe", microbatches=4, remat=True)),
    ("pp2-1f1b-m4-remat", dict(pp=2, schedule="1f1b", microbatches=4, remat=True)),
    ("ddp-clip", dict(clip=True)),
    ("zero1-clip", dict(zero=1, bucket_mb=0.02, clip=True)),
    ("zero2-clip", dict(zero=2, bucket_mb=0.02, clip=True)),
    ("zero3-clip", dict(zero=3, clip=True)),
    ("fsdp-tied-clip", dict(fsdp=True, tied=True, clip=True)),
    ("tp2-clip", dict(tp=2, clip=True)),
    ("pp2-1f1b-m2-tied-clip", dict(pp=2, microbatches=2, tied=True, clip=True)),
]

LAYOUTS_4 = [
    ("ddp-dp4", dict()),
    ("zero2-dp4", dict(zero=2)),
    ("zero3-dp4", dict(zero=3)),
    ("hsdp-2x2", dict(hsdp=2)),
    ("dp2xtp2-ddp", dict(dp=2, tp=2)),
    ("dp2xtp2-fsdp-tied", dict(dp=2, tp=2, fsdp=True, tied=True)),
    ("dp2xtp2-zero1", dict(dp=2, tp=2, zero=1)),
    ("dp2xpp2-ddp-tied", dict(dp=2, pp=2, microbatches=2, tied=True)),
    ("dp2xpp2-zero1", dict(dp=2, pp=2, zero=1, microbatches=2, schedule="gpipe")),
    ("dp2xpp2-fsdp", dict(dp=2, pp=2, fsdp=True, microbatches=2)),
    ("tp2xpp2", dict(tp=2, pp=2, microbatches=4)),
    ("tp2xpp2-tied-gpipe", dict(tp=2, pp=2, microbatches=2, schedule="gpipe", tied=True)),
    ("hsdp-2x2-remat", dict(hsdp=2, remat=True)),
    ("dp2xtp2-remat", dict(dp=2, tp=2, remat=True)),
    ("tp2xpp2-remat", dict(tp=2, pp=2, microbatches=2, remat=True)),
    ("dp2xpp2-remat", dict(dp=2, pp=2, microbatches=2, remat=True)),
    ("hsdp-2x2-clip", dict(hsdp=2, clip=True)),
    ("dp2xtp2-zero1-clip", dict(dp=2, tp=2, zero=1, bucket_mb=0.02, clip=True)),
    ("dp2xpp2-zero1-tied-clip", dict(dp=2, pp=2, zero=1, microbatches=2, tied=True, clip=True)),
    ("tp2xpp2-clip", dict(tp=2, pp=2, microbatches=2, clip=True)),
    # Constant-size buffers (--fsdp-buffer-mb, test_parallel_buffers) inside the composed layouts.
    ("zero3-dp4-cb", dict(zero=3, fsdp_buffer_mb=0.005)),
    ("hsdp-2x2-cb-remat-clip", dict(hsdp=2, remat=True, clip=True, fsdp_buffer_mb=0.005)),
    ("dp2xtp2-fsdp-tied-cb", dict(dp=2, tp=2, fsdp=True, tied=True, fsdp_buffer_mb=0.005)),
    ("dp2xpp2-fsdp-cb", dict(dp=2, pp=2, fsdp=True, microbatches=2, fsdp_buffer_mb=0.005)),
    ("fsdp-dp4-accum-cb", dict(fsdp=True, microbatches=2, fsdp_buffer_mb=0.005)),
]


@pytest.fixture(scope="module")
def refs(fidelity_refs):
    assert all(n > MAX_NORM for tied in (False, True) for n in fidelity_refs[tied, True][2])  # clipping is active
    return fidelity_refs


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world_size,layouts", [(2, LAYOUTS_2), (4, LAYOUTS_4)], ids=["2ranks", "4ranks"])
def test_layouts_match_single_process(world_size, layouts, refs):
    results = spawn(run_layouts, world_size, args=(layouts, refs), timeout_s=480)
    check_layouts(results, layouts)


def test_world_size_one_is_the_same_code_path(refs):
    layouts = [
        ("ddp", dict()),
        ("zero2", dict(zero=2)),
        ("fsdp-remat", dict(fsdp=True, remat=True)),
        ("accum", dict(microbatches=4)),
        ("zero1-clip", dict(zero=1, clip=True)),
        ("fsdp-tied-clip", dict(fsdp=True, tied=True, clip=True)),
    ]
    check_layouts([run_layouts(0, 1, layouts, refs)], layouts)
