"""Failed training is reported as failed, at once and by name: a NaN, a dead
server, a model that does not fit the job, an exception in a hook."""
import re
import time

import pytest

from front_jobs import launch


@pytest.mark.parametrize("overlap", [True, False])
def test_nan_gradient_is_an_exception_and_fails_the_job(tmp_path, overlap):
    r, s = launch(tmp_path, 2, 1, ["--optimizer=adam", "--lr=0.01"],
                  "6 --nan_at 2" + ("" if overlap else " --no_overlap"))
    assert r.returncode != 0
    assert "torch_worker: step 2:" in r.stderr
    assert "non-finite" in r.stderr
    # Named as the user knows it: model[2].bias, element 1.
    assert "(parameter 2.bias[1])" in r.stderr
    # The failed step applied nothing to the replica that saw the NaN.
    assert "[worker1] torch_worker: step 2: replica unchanged" in r.stderr
    assert s.get("status", "").startswith("failed")


def test_a_model_on_another_device_than_the_worker_is_refused_naming_both(tmp_path):
    r, s = launch(tmp_path, 2, 1, ["--optimizer=adam"], "3 --model_device meta")
    assert r.returncode != 0
    assert ("torch_worker: 0.weight is on meta but this worker's buffers are on cpu (cpu): "
            "move the model there first, or start the worker with ONEBIT_DEVICE=meta") in r.stderr


def test_a_rank_with_another_model_size_is_refused_at_init(tmp_path):
    r, s = launch(tmp_path, 2, 1, ["--optimizer=adam"], "3 --wider_rank 1")
    assert r.returncode != 0
    assert "declares d = " in r.stderr
    assert "d = 804" in r.stderr and "d = 829" in r.stderr


def test_a_dead_server_is_an_exception_within_the_step_timeout(tmp_path):
    # The coordinator would notice only after its 60 s heartbeat timeout: the
    # worker's own wait (twice the 2 s step timeout) must end the step first.
    r, s = launch(tmp_path, 2, 2, ["--optimizer=adam", "--step_timeout=2s",
                                   "--heartbeat_timeout=60s"],
                  "20 --stop_server_at 3")
    assert r.returncode != 0
    m = re.search(r"\[worker0\] torch_worker: step 3: (.*) \(failed ([0-9.]+) s after the stop\)",
                  r.stderr)
    assert m, r.stderr
    assert "server 0" in m.group(1) and "is it dead?" in m.group(1)
    assert "within 4s" in m.group(1)  # the worker's own bound, twice the step timeout
    # Not before that bound; and by the worker's wait, not the coordinator's
    # 60 s heartbeat timeout (the upper bound leaves a loaded machine room).
    assert 3.5 < float(m.group(2)) < 30
    assert s.get("status", "").startswith("failed")


def test_an_exception_in_a_backward_hook_ends_the_job_failed_at_once(tmp_path):
    # Rank 1's own tensor hook raises inside backward(); its program dies of
    # it. The job must fail at once (not after the 60 s heartbeat timeout,
    # nor hang in the interpreter's exit), naming why.
    start = time.monotonic()
    r, s = launch(tmp_path, 2, 1, ["--optimizer=adam", "--heartbeat_timeout=60s",
                                   "--step_timeout=60s"], "6 --raise_in_hook 2")
    took = time.monotonic() - start
    assert r.returncode != 0
    assert "[worker1] ZeroDivisionError" in r.stderr, r.stderr
    assert "launch: stopping worker1" not in r.stderr  # it exited by itself
    assert ("rank 1's program exited without onebit_ps.finish() (an uncaught exception? see its "
            "log)") in s["status"], s
    assert took < 30, took


def test_an_error_in_the_fronts_own_hook_fails_the_job_at_once(tmp_path):
    # A scheduler that changes the ratio of the groups' learning rates (made
    # equal, then 0.001 and 0.002): the servers hold the ratio, so the front
    # refuses in its hook, at the first push of the step.
    start = time.monotonic()
    r, s = launch(tmp_path, 2, 1, ["--optimizer=adam", "--heartbeat_timeout=60s",
                                   "--step_timeout=60s"], "6 --group_lrs_at 2")
    assert r.returncode != 0
    assert re.search(r"\[worker[01]\] torch_worker: step 2: param group 1 has lr 0\.002, but the "
                     r"servers step it at 1\.0 x group 0's lr 0\.001 = 0\.001", r.stderr), r.stderr
    assert "aborted by its program: param group 1 has lr 0.002" in s["status"]
    assert time.monotonic() - start < 30
