"""tandem's learning-rate schedules against transformers' get_scheduler, step by step.

For each schedule (linear, cosine, constant, constant_with_warmup), base learning rate, warmup and total, the
learning rate of every optimizer step 0..total+2 (past the end too) is read from a torch optimizer driven by
transformers' scheduler, the way the Trainer drives it (optimizer.step(), then scheduler.step()), and must
equal tandem's value exactly: the same double-precision formulas in the same order. The warmup step count
from warmup_steps (an integer, or a ratio below 1) equals TrainingArguments.get_warmup_steps; warmup_ratio
(transformers 4's key, used when warmup_steps is 0) equals its formula ceil(total * ratio).
"""
import json
import math

import pytest
import torch
from transformers import TrainingArguments
from transformers.optimization import get_scheduler

from conftest import run_tool, tool


def hf_lrs(name, base_lr, warmup, total, n):
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=base_lr)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def tandem(name, base_lr, warmup_steps, warmup_ratio, total, n):
    out = run_tool([tool("trainer_lr_tool"), name, repr(base_lr), repr(warmup_steps), repr(warmup_ratio),
                    str(total), str(n)])
    return json.loads(out)


CASES = [(1e-6, 0, 100), (3e-4, 10, 100), (1.0, 1, 7), (5e-5, 50, 50), (2e-5, 0.1, 257), (1e-3, 0.5, 3),
         (7e-6, 30, 20), (1e-4, 0, 1)]


@pytest.mark.parametrize("name", ["linear", "cosine", "constant", "constant_with_warmup"])
@pytest.mark.parametrize("base_lr,warmup_steps,total", CASES)
def test_schedule_matches_transformers(name, base_lr, warmup_steps, total, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), warmup_steps=warmup_steps, use_cpu=True, report_to=[])
    warmup = args.get_warmup_steps(total)
    n = total + 3
    got = tandem(name, base_lr, warmup_steps, 0.0, total, n)
    assert got["warmup"] == warmup
    want = hf_lrs(name, base_lr, warmup, total, n)
    assert got["lrs"] == want


@pytest.mark.parametrize("ratio,total", [(0.1, 100), (0.03, 1000), (0.25, 7), (1.0, 9)])
def test_warmup_ratio(ratio, total):
    got = tandem("cosine", 1e-5, 0.0, ratio, total, total + 1)
    warmup = math.ceil(total * ratio)
    assert got["warmup"] == warmup
    assert got["lrs"] == hf_lrs("cosine", 1e-5, warmup, total, total + 1)
