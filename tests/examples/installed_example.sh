#!/usr/bin/env bash
# The C++ example as an outside project: install onebit-ps into a prefix,
# build examples/cpp against it with find_package(onebit), and train its own
# model on a 4 x 2 cluster with the installed onebit-launch; then, where the
# PyTorch front was built, a torch script over the installed onebit_ps, which
# the launcher puts on the script's PYTHONPATH itself.
#   installed_example.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1
build=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
cmake -S "$src/examples/cpp" -B "$tmp/example" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/example" >/dev/null
"$tmp/prefix/bin/onebit-launch" --workers 4 --servers 2 --model external \
  --optimizer onebit-adam --freeze_step 20 --lr 0.005 --out "$tmp/run" \
  --worker_cmd "$tmp/example/softmax_train --steps 60 --batch 32 --max_train 4000" \
  >"$tmp/log" 2>&1 || { cat "$tmp/log"; exit 1; }
summary=$(cat "$tmp/run/summary.json")
fail() { echo "installed_example: $1"; cat "$tmp/log"; echo "$summary"; exit 1; }
grep -q '"replicas_equal": true' <<<"$summary" || fail "replicas differ"
grep -q '"status": "ok"' <<<"$summary" || fail "job not ok"
grep -q '"params": 7850' <<<"$summary" || fail "wrong d"
grep -q '"steps": 60' <<<"$summary" || fail "wrong step count"
acc=$(grep -o 'test accuracy [0-9.]*' "$tmp/log" | awk '{print $3}')
# Softmax regression reaches ~0.7 on Fashion-MNIST within 60 small steps;
# a broken update stays near chance (0.1).
awk -v a="$acc" 'BEGIN { exit !(a > 0.5) }' || fail "test accuracy $acc"
echo "installed_example: ok (test accuracy $acc)"

pkg=$tmp/prefix/lib/python3/dist-packages
[ -d "$pkg/onebit_ps" ] || { echo "installed_example: no PyTorch front built; done"; exit 0; }
where=$(PYTHONPATH=$pkg /usr/bin/python3 -c 'import onebit_ps; print(onebit_ps.__file__)')
[ "$where" = "$pkg/onebit_ps/__init__.py" ] || { echo "installed_example: imported $where"; exit 1; }
# No PYTHONPATH and no --model: the installed launcher puts its own package
# first on the worker's PYTHONPATH, and --worker_cmd implies --model external.
env -u PYTHONPATH "$tmp/prefix/bin/onebit-launch" --workers 2 --servers 1 \
  --optimizer onebit-adam --freeze_step 3 --lr 0.01 --out "$tmp/torch" \
  --worker_cmd "/usr/bin/python3 $src/tests/python/torch_worker.py 8" >"$tmp/log" 2>&1 ||
  { cat "$tmp/log"; exit 1; }
summary=$(cat "$tmp/torch/summary.json")
grep -q '"replicas_equal": true' <<<"$summary" || fail "torch replicas differ"
grep -q '"compress_steps": 5' <<<"$summary" || fail "torch job did not compress"
echo "installed_example: ok (onebit_ps from $pkg)"
