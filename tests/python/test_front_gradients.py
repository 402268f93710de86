"""torch's gradient habits through the front (hooks, clipping, accumulation,
.grad set by hand, frozen parameters): exact where torch is, a named
failure where the servers could not follow."""
import os
import re
import subprocess

import pytest

from front_jobs import BIN, HERE, launch, summary_of


def test_pushing_from_the_backward_hooks_changes_nothing(tmp_path):
    # With a scheduler too: its lr must reach the servers before the hooks'
    # first push of the step.
    runs = {}
    for overlap, sched in [(True, False), (False, False), (True, True), (False, True)]:
        d = tmp_path / f"{overlap}-{sched}"
        d.mkdir()
        r, s = launch(d, 3, 2, ["--optimizer=onebit-adam", "--freeze_step=4", "--lr=0.01",
                                "--block_size=32", "--chunk_elems=64", "--dump_params"],
                      "10" + ("" if overlap else " --no_overlap") + (" --schedule" if sched else ""))
        assert r.returncode == 0, r.stderr
        assert s["replicas_equal"] is True
        runs[overlap, sched] = [(d / "run" / f"replica_w{i}.f32").read_bytes() for i in range(3)]
    assert len(runs[True, False][0]) == 4 * (20 * 32 + 32 + 32 * 4 + 4)
    assert runs[True, False] == runs[False, False]
    assert runs[True, True] == runs[False, True]
    # The schedule reached the servers: another lr, another result.
    assert runs[True, True] != runs[True, False]


def grad_case(tmp_path, case, steps, flags=("--optimizer=sgd", "--lr=1")):
    out = tmp_path / "run"
    cmd = [os.path.join(BIN, "onebit-launch"), "--workers=2", "--servers=1", "--model=external",
           f"--steps={steps}", f"--out={out}", "--launch_register_timeout=30s", *flags,
           f"--worker_cmd=/usr/bin/python3 {HERE}/grad_worker.py {case}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    return r, summary_of(out)


@pytest.mark.parametrize("case", ["clip_no_overlap", "accumulate_no_sync", "accumulate_no_overlap",
                                  "replaced_grad"])
def test_torch_gradient_habits_train_exactly(tmp_path, case):
    # grad_worker checks w to the bit: the clipped gradient (not the 7.4e4
    # norm one), both accumulated backward passes (-2, not -1), a .grad the
    # program assigned.
    r, s = grad_case(tmp_path, case, 1)
    assert r.returncode == 0, r.stderr
    assert f"grad_worker: {case} ok" in r.stderr
    assert s["status"] == "ok" and s["replicas_equal"] is True


def test_a_gradient_changed_after_its_overlapped_push_fails_naming_it(tmp_path):
    # clip_grad_norm_ after backward() with overlap=True: the servers have the
    # unclipped gradient, so the step must not go on as if clipped.
    r, s = grad_case(tmp_path, "clip", 1)
    assert r.returncode != 0
    assert re.search(r"\[worker[01]\] grad_worker: clip error: the gradient of w, v changed after "
                     r"backward\(\) had pushed it", r.stderr), r.stderr
    assert "pass overlap=False" in r.stderr
    assert "grad_worker: clip ok" not in r.stderr
    assert s["status"].startswith("failed") and "changed after backward()" in s["status"]


def test_a_second_backward_into_a_pushed_gradient_fails_naming_it(tmp_path):
    r, s = grad_case(tmp_path, "accumulate", 1)
    assert r.returncode != 0
    assert re.search(r"grad_worker: accumulate error: (v|w): a second backward\(\) accumulated "
                     r"into its gradient after this step had pushed it", r.stderr), r.stderr
    assert "with opt.no_sync()" in r.stderr
    assert s["status"].startswith("failed")


def test_a_step_without_any_gradient_does_nothing_as_in_torch(tmp_path):
    r, s = grad_case(tmp_path, "set_to_none", 2, ("--optimizer=adam", "--lr=0.01"))
    assert r.returncode == 0, r.stderr
    assert "grad_worker: set_to_none ok" in r.stderr
    assert s["steps"] == 2 and s["replicas_equal"] is True


@pytest.mark.parametrize("case,message", [
    ("set_to_none_partly", r"v got no gradient in this step \(\.grad is None"),
    ("frozen", r"v: requires_grad is False now, but the optimizer trains it"),
])
def test_a_parameter_left_out_of_a_step_fails_naming_it(tmp_path, case, message):
    r, s = grad_case(tmp_path, case, 2)
    assert r.returncode != 0
    assert re.search(rf"grad_worker: {case} error: {message}", r.stderr), r.stderr
    assert s["status"].startswith("failed")


def test_a_nan_loss_reported_to_step_fails_the_job_naming_rank_and_step(tmp_path):
    r, s = grad_case(tmp_path, "nan_loss", 1)
    assert r.returncode != 0
    assert "grad_worker: nan_loss error: loss is not finite (nan) at rank 1 step 0" in r.stderr, \
        r.stderr
    assert "loss is not finite (nan) at rank 1 step 0" in s["status"]


def test_buffers_that_differ_between_ranks_fail_the_job_naming_them(tmp_path):
    # Buffers are not trained or broadcast: ranks that start them apart would
    # train different models while replicas_equal said true.
    r, s = grad_case(tmp_path, "buffers", 1)
    assert r.returncode != 0
    assert re.search(r"worker [01]'s scale differs from worker [01]'s \(CRC-32 [0-9a-f]{8} against "
                     r"[0-9a-f]{8}\): tensors the job does not train", r.stderr), r.stderr
    assert "grad_worker: buffers ok" not in r.stderr


@pytest.mark.parametrize("case,message", [
    ("second_optimizer", "this process has made a DistributedOptimizer already (rank "),
    ("double", "w is a torch.float64 parameter of shape (5,): onebit-ps trains dense float32, "
               "bfloat16 or float16 parameters"),
])
def test_unsupported_uses_are_refused_naming_what(tmp_path, case, message):
    r, s = grad_case(tmp_path, case, 1)
    assert r.returncode != 0
    assert f"grad_worker: {case} error: {message}" in r.stderr, r.stderr
